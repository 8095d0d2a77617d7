"""Beam search over the engine's scheduler and runner, with beams sharing KV blocks by fork.

Each beam is a core Request sampled greedily with the top 2 x beam_width logprobs. After
a step every beam holds one new token whose K/V is not computed yet, so choosing the
next beams is cheap:

    beam b picked with token t    -> b's last token becomes t (nothing to recompute)
    beam b picked again, token t' -> fork b (blocks shared by refcount, copied on write)
    beam b not picked             -> finished, its blocks freed

Scores follow transformers: beams are ranked by cumulative logprob while running;
finished hypotheses by cum_logprob / num_generated_tokens ** length_penalty.
"""

import dataclasses
import itertools

from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.engine.detokenizer import decode_ids
from jaxpaged.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams


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
    request: Request
    cum_logprob: float
    logprobs: list[float]


class _Group:
    """The beams of one prompt."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, root: Request):
        self.prompt_ids = prompt_ids
        self.params = params
        self.beams = [_Beam(root, 0.0, [])]
        self.finished: list[tuple[float, BeamSearchSequence]] = []

    def score(self, seq: BeamSearchSequence) -> float:
        generated = max(len(seq.tokens) - len(self.prompt_ids), 1)
        return seq.cum_logprob / generated ** self.params.length_penalty

    def is_done(self, width: int) -> bool:
        """transformers' heuristic (early_stopping=False): no running beam can beat the worst kept hypothesis."""
        if len(self.finished) < width or not self.beams:
            return not self.beams
        worst = sorted(s for s, _ in self.finished)[-width]
        generated = self.beams[0].request.num_output_tokens
        best = max(b.cum_logprob for b in self.beams) / max(generated, 1) ** self.params.length_penalty
        return worst >= best

    def add_finished(self, beam: _Beam, tokens: list[int], cum: float, lps: list[float], reason: str) -> None:
        seq = BeamSearchSequence(list(self.prompt_ids) + tokens, cum, logprobs=lps, finish_reason=reason)
        self.finished.append((self.score(seq), seq))


def run_beam_search(engine, prompts: list[list[int]], params: BeamSearchParams,
                    loras: list | None = None) -> list[BeamSearchOutput]:
    """`loras`: each prompt's LoRARequest (or None: the base model); None: the base model for all."""
    width = params.beam_width
    if 2 * width > MAX_LOGPROBS:
        raise ValueError(f"beam_width must be <= {MAX_LOGPROBS // 2}, got {width}")
    if engine.has_unfinished_requests():
        raise ValueError("beam_search needs an idle engine; wait for pending requests first")
    if width > engine.scheduler.config.max_num_seqs:
        raise ValueError(f"beam_width ({width}) must be <= max_num_seqs ({engine.scheduler.config.max_num_seqs})")
    per_wave = max(1, engine.scheduler.config.max_num_seqs // width)   # all beams of a wave run together
    outputs = []
    for i in range(0, len(prompts), per_wave):
        outputs += _run_wave(engine, prompts[i:i + per_wave], params, (loras or [None] * len(prompts))[i:i + per_wave])
    return outputs


def _run_wave(engine, prompts: list[list[int]], params: BeamSearchParams, loras: list) -> list[BeamSearchOutput]:
    width = params.beam_width
    scheduler, runner = engine.scheduler, engine.runner
    ids = itertools.count()
    sampling = SamplingParams(temperature=0.0, logprobs=2 * width, max_tokens=params.max_tokens,
                              ignore_eos=True, detokenize=False)
    groups = []
    for prompt, lora in zip(prompts, loras):
        engine._validate(prompt, sampling)
        root = Request(f"beam-{next(ids)}", prompt, sampling, engine.eos_token_ids, seed=0,
                       max_tokens=params.max_tokens, cache_salt=engine._add_lora(lora, None), lora_request=lora)
        scheduler.add_request(root)
        groups.append(_Group(prompt, params, root))

    def new_request(parent: Request) -> Request:
        return Request(f"beam-{next(ids)}", parent.prompt_token_ids, sampling, engine.eos_token_ids, seed=0,
                       max_tokens=params.max_tokens, cache_salt=parent.cache_salt, lora_request=parent.lora_request)

    # request id -> its SampledToken since the last selection. A beam with such a token is parked
    # (scheduler.park: out of scheduling, keeping its blocks) until its group selects: it must not decode
    # further, and a preempted sibling may take several steps to catch up.
    fresh: dict[str, object] = {}
    try:
        while any(g.beams for g in groups):
            plan = scheduler.schedule()
            if plan.is_empty:
                runner.run_without_step(plan)
                if plan.preempted:   # back in the waiting queue (a LongRoPE beam outgrowing its factors)
                    continue
                raise RuntimeError("beam search is stuck: the KV cache cannot hold all beams of a prompt at once; "
                                   "give the engine more blocks or lower beam_width")
            engine.assign_loras(plan)
            result = runner.fetch(runner.dispatch(plan))
            for request in scheduler.update_after_step(plan, {k: v.token_id for k, v in result.sampled.items()}):
                fresh[request.request_id] = result.sampled[request.request_id]
                scheduler.park(request)
            for group in groups:
                if group.beams and all(b.request.request_id in fresh for b in group.beams):
                    for beam in group.beams:
                        scheduler.unpark(beam.request)
                    _select(group, fresh, scheduler, new_request, engine.eos_token_ids, width)
    finally:
        for request in list(scheduler.requests.values()):
            if request.request_id.startswith("beam-"):
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
    tokenizer = engine.tokenizer
    outputs = []
    for group in groups:
        ranked = [seq for _, seq in sorted(group.finished, key=lambda x: -x[0])][:width]
        for seq in ranked:
            if tokenizer is not None:
                seq.text = decode_ids(tokenizer, seq.tokens[len(group.prompt_ids):], skip_special_tokens=True)
        outputs.append(BeamSearchOutput(ranked))
    return outputs


def _select(group: _Group, fresh: dict, scheduler, new_request, eos_ids, width: int) -> None:
    candidates = []
    for beam in group.beams:
        sampled = fresh.pop(beam.request.request_id)
        for tid, lp in zip(sampled.top_ids, sampled.top_logprobs):
            candidates.append((beam.cum_logprob + lp, lp, tid, beam))
    candidates.sort(key=lambda c: -c[0])
    chosen = []
    for rank, (cum, lp, tid, beam) in enumerate(candidates[:2 * width]):
        tokens = beam.request.output_token_ids[:-1] + [tid]
        if tid in eos_ids and not group.params.ignore_eos:
            if rank < width:   # as transformers: an EOS ranked past beam_width is dropped
                group.add_finished(beam, tokens, cum, beam.logprobs + [lp], "stop")
        else:
            chosen.append((cum, lp, tid, beam))
        if len(chosen) == width:
            break
    reused: set[int] = set()
    next_beams = []
    for cum, lp, tid, beam in chosen:   # forks first, while parents still hold their blocks
        if id(beam) in reused:
            child = new_request(beam.request)
            scheduler.fork(beam.request, child)
            for t in beam.request.output_token_ids[:-1] + [tid]:
                child.append_output_token(t)
            next_beams.append(_Beam(child, cum, beam.logprobs + [lp]))
        else:
            reused.add(id(beam))
            next_beams.append(None)
    for i, (cum, lp, tid, beam) in enumerate(chosen):
        if next_beams[i] is None:
            beam.request.output_token_ids[-1] = tid
            beam.request.all_token_ids[-1] = tid
            next_beams[i] = _Beam(beam.request, cum, beam.logprobs + [lp])
    for beam in group.beams:
        if id(beam) not in reused:
            scheduler.finish_request(beam.request.request_id, RequestStatus.FINISHED_ABORTED)
    group.beams = []
    for beam in next_beams:
        request = beam.request
        if request.num_output_tokens >= group.params.max_tokens or request.num_tokens >= scheduler.config.max_model_len:
            group.add_finished(beam, list(request.output_token_ids), beam.cum_logprob, beam.logprobs, "length")
            scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        else:
            group.beams.append(beam)
    if group.beams and group.is_done(width):
        for beam in group.beams:
            scheduler.finish_request(beam.request.request_id, RequestStatus.FINISHED_ABORTED)
        group.beams = []
