"""Beam search on top of generation (as vLLM's `LLM.beam_search`): each round, every running beam
is a one-token request of the engine whose prompt is the beam so far, asking for the top
2 x beam_width logprobs; the next beams are chosen from those. The prefix cache keeps the blocks
that beams share (the prompt, common prefixes) computed once; nothing in the scheduler or the
runner knows about beams.

Scores follow transformers: beams are ranked by cumulative logprob while running;
finished hypotheses by cum_logprob / num_generated_tokens ** length_penalty.
"""

import dataclasses

from jaxpaged.engine.detokenizer import decode_ids
from jaxpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]                  # prompt + generated tokens, as vLLM returns them
    cum_logprob: float
    text: str | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first


@dataclasses.dataclass
class _Beam:
    tokens: list[int]                 # generated so far
    cum_logprob: float
    logprobs: list[float]


class _Group:
    """The beams of one prompt."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, lora_request=None):
        self.prompt_ids = prompt_ids
        self.params = params
        self.lora_request = lora_request
        self.beams = [_Beam([], 0.0, [])]
        self.finished: list[tuple[float, BeamSearchSequence]] = []

    def score(self, seq: BeamSearchSequence) -> float:
        generated = max(len(seq.tokens) - len(self.prompt_ids), 1)
        return seq.cum_logprob / generated ** self.params.length_penalty

    def is_done(self, width: int) -> bool:
        """transformers' heuristic (early_stopping=False): no running beam can beat the worst kept hypothesis."""
        if len(self.finished) < width or not self.beams:
            return not self.beams
        worst = sorted(s for s, _ in self.finished)[-width]
        generated = len(self.beams[0].tokens)
        best = max(b.cum_logprob for b in self.beams) / max(generated, 1) ** self.params.length_penalty
        return worst >= best

    def add_finished(self, tokens: list[int], cum: float, lps: list[float], reason: str) -> None:
        seq = BeamSearchSequence(list(self.prompt_ids) + tokens, cum, logprobs=lps, finish_reason=reason)
        self.finished.append((self.score(seq), seq))


def run_beam_search(engine, prompts: list[list[int]], params: BeamSearchParams,
                    loras: list | None = None) -> list[BeamSearchOutput]:
    """`loras`: each prompt's LoRARequest (or None: the base model); None: the base model for all."""
    width = params.beam_width
    if 2 * width > engine.args.max_logprobs:
        raise ValueError(f"beam_width must be <= max_logprobs / 2 ({engine.args.max_logprobs // 2}), got {width}")
    if engine.has_unfinished_requests():
        raise ValueError("beam_search needs an idle engine; wait for pending requests first")
    # each round's requests: the beam so far, one token to sample with its 2 x width best alternatives
    sampling = SamplingParams(temperature=0.0, logprobs=2 * width, max_tokens=1, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)
    groups = []
    for prompt, lora in zip(prompts, loras or [None] * len(prompts)):
        # (a beam's prompt stays under max_model_len, which the KV cache holds: a beam always fits alone)
        engine.input_processor.validate(prompt, sampling)
        groups.append(_Group(prompt, params, lora))
    while any(g.beams for g in groups):
        asked = []   # (group, beam, request id)
        try:
            for group in groups:
                for beam in group.beams:
                    request_id = engine.add_request(None, {"prompt_token_ids": group.prompt_ids + beam.tokens},
                                                    sampling, lora_request=group.lora_request)
                    asked.append((group, beam, request_id))
            finals = {}
            while engine.has_unfinished_requests():
                finals.update((out.request_id, out) for out in engine.step())
        except BaseException:
            for _, _, request_id in asked:
                engine.abort_request(request_id)
            raise
        candidates = {id(group): [] for group in groups}
        for group, beam, request_id in asked:
            (top,) = finals[request_id].outputs[0].logprobs
            for token, lp in sorted(top.items(), key=lambda item: item[1].rank)[:2 * width]:
                candidates[id(group)].append((beam.cum_logprob + lp.logprob, lp.logprob, token, beam))
        for group in groups:
            if group.beams:
                _select(group, candidates[id(group)], engine.eos_token_ids, engine.max_model_len, width)
    tokenizer = engine.tokenizer
    outputs = []
    for group in groups:
        ranked = [seq for _, seq in sorted(group.finished, key=lambda x: -x[0])][:width]
        for seq in ranked:
            if tokenizer is not None:
                seq.text = decode_ids(tokenizer, seq.tokens[len(group.prompt_ids):], skip_special_tokens=True)
        outputs.append(BeamSearchOutput(ranked))
    return outputs


def _select(group: _Group, candidates: list, eos_ids, max_model_len: int, width: int) -> None:
    """The next beams of `group` from its (cumulative logprob, logprob, token, beam) candidates."""
    candidates.sort(key=lambda c: -c[0])
    chosen = []
    for rank, (cum, lp, tid, beam) in enumerate(candidates[:2 * width]):
        tokens = beam.tokens + [tid]
        if tid in eos_ids and not group.params.ignore_eos:
            if rank < width:   # as transformers: an EOS ranked past beam_width is dropped
                group.add_finished(tokens, cum, beam.logprobs + [lp], "stop")
        else:
            chosen.append(_Beam(tokens, cum, beam.logprobs + [lp]))
        if len(chosen) == width:
            break
    group.beams = []
    for beam in chosen:
        if len(beam.tokens) >= group.params.max_tokens or len(group.prompt_ids) + len(beam.tokens) >= max_model_len:
            group.add_finished(beam.tokens, beam.cum_logprob, beam.logprobs, "length")
        else:
            group.beams.append(beam)
    if group.beams and group.is_done(width):
        group.beams = []
