"""Turn sampled tokens into what users see: text, logprobs, stop decisions, RequestOutputs.

Token-level stops (EOS, stop_token_ids, max_tokens, max_model_len) are decided as soon as
a token arrives, before the next step is scheduled. Text-level work (detokenization, stop
strings) runs while the device computes the next step; a stop string found there
finishes the request one step late and the extra token is dropped.
"""

from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_token
from jaxpaged.engine.stop_checker import check_stop_strings
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.runner.model_runner import PromptLogprobs, SampledToken


class SequenceState:
    """Output-side state of one sequence (one of the n samples of a request)."""

    def __init__(self, request: Request, index: int, tokenizer, parent_id: str):
        self.request = request
        self.parent_id = parent_id
        self.index = index
        params = request.sampling_params
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                   params.skip_special_tokens,
                                                   params.spaces_between_special_tokens)
                            if params.detokenize and tokenizer is not None else None)
        self.text = ""
        self.num_detokenized = 0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text=self.text,
                                token_ids=list(self.request.output_token_ids),
                                cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class RequestState:
    """A user request: its prompt and its n sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sequences: list[SequenceState]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sequences = sequences
        self.prompt_logprobs: list | None = None
        self.wants_prompt_logprobs = sequences[0].request.sampling_params.prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        first = self.sequences[0].request
        prompt_lps = None
        if self.wants_prompt_logprobs:
            prompt_lps = [None] + list(self.prompt_logprobs or [])
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, prompt_logprobs=prompt_lps,
                             outputs=[s.completion() for s in self.sequences], finished=self.finished,
                             num_cached_tokens=max(first.num_cached_tokens, 0))


def token_stop(request: Request, max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """Stop decided by the last token alone: (status, stop_reason) or None to go on."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in (params.stop_token_ids or ()):
            return RequestStatus.FINISHED_STOPPED, token
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def record_logprobs(seq: SequenceState, sampled: SampledToken, tokenizer) -> None:
    seq.cumulative_logprob += sampled.logprob
    if seq.logprobs is None:
        return
    k = seq.request.sampling_params.logprobs
    entry = {}
    for rank, (tid, lp) in enumerate(zip(sampled.top_ids[:k], sampled.top_logprobs[:k]), start=1):
        entry[tid] = Logprob(lp, rank, _decoded(tokenizer, tid))
    entry[sampled.token_id] = Logprob(sampled.logprob, sampled.rank, _decoded(tokenizer, sampled.token_id))
    seq.logprobs.append(entry)


def record_prompt_logprobs(state: RequestState, lps: PromptLogprobs, tokenizer) -> None:
    if state.prompt_logprobs is None:
        state.prompt_logprobs = []
    # after a recompute preemption chunks may start before what we already have: keep the new part
    skip = len(state.prompt_logprobs) - lps.start
    if skip < 0:
        raise RuntimeError(f"prompt logprobs of {state.request_id} arrived out of order")
    k = state.sequences[0].request.sampling_params.prompt_logprobs
    for i, (lp, rank) in enumerate(zip(lps.logprobs, lps.ranks)):
        if i < skip:
            continue
        target = state.prompt_token_ids[lps.start + 1 + i]
        entry = {tid: Logprob(l, r, _decoded(tokenizer, tid))
                 for r, (tid, l) in enumerate(zip(lps.top_ids[i][:k], lps.top_logprobs[i][:k]), start=1)}
        entry[target] = Logprob(lp, rank, _decoded(tokenizer, target))
        state.prompt_logprobs.append(entry)


def _decoded(tokenizer, token_id: int) -> str | None:
    return decode_token(tokenizer, token_id) if tokenizer is not None else None


def detokenize(seq: SequenceState) -> tuple[str, int] | None:
    """Bring seq.text up to date; returns (stop string, truncate-to) when a stop string matched."""
    request = seq.request
    params = request.sampling_params
    new_ids = request.output_token_ids[seq.num_detokenized:]
    seq.num_detokenized = request.num_output_tokens
    if seq.detokenizer is None or not new_ids:
        return None
    delta = seq.detokenizer.add_tokens(new_ids)
    if seq.finish_reason is not None:
        delta += seq.detokenizer.flush()
    seq.text += delta
    if params.stop and delta and request.num_output_tokens >= params.min_tokens:
        return check_stop_strings(seq.text, len(delta), params.stop, params.include_stop_str_in_output)
    return None
