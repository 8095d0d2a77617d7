"""Turn sampled tokens into what users see: text, logprobs, stop decisions, RequestOutputs.

Token-level stops (EOS, stop_token_ids, max_tokens, max_model_len, grammars) are the
scheduler's (`Scheduler.update_from_output`), decided as soon as a token arrives, before the
next step is scheduled. Text-level work (detokenization, stop strings) runs while the device
computes the next step; a stop string found there finishes the request one step late and the
extra token is dropped. A FINAL_ONLY sequence without stop strings is detokenized once, at its end.

Each request gets the outputs its `SamplingParams.output_kind` asks for: CUMULATIVE copies
everything so far every step; DELTA slices off only what earlier outputs did not carry
(per-sequence "sent" offsets), so a long generation costs O(new tokens) per step;
FINAL_ONLY builds one cumulative output, at the end.
"""

from jaxpaged.core.request import Request
from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_token
from jaxpaged.engine.stop_checker import check_stop_strings, stop_hold_back
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.runner.step_results import PromptLogprobs, SampledToken
from jaxpaged.sampling_params import RequestOutputKind


class SequenceState:
    """Output-side state of one sequence (one of the n samples of a request)."""

    def __init__(self, request: Request, index: int, tokenizer, parent_id: str):
        self.request = request
        self.parent_id = parent_id
        self.index = index
        params = request.sampling_params
        prompt_ids = [] if request.num_embeds_tokens else request.prompt_token_ids   # embeddings: no text before
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_ids,
                                                   params.skip_special_tokens,
                                                   params.spaces_between_special_tokens)
                            if params.detokenize and tokenizer is not None else None)
        self.token_ids: list[int] = []   # the output's own copy of the sequence's generated tokens
        self.text = ""
        self.num_detokenized = 0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.step_logprobs: list[float] = []   # the last step's tokens' logprobs (speculative decoding)
        self.num_dropped = 0                   # of the last step's tokens, those after a stop string
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.pooled = None                     # runner="pooling": its prompt's pooled hidden state, once computed
        # DELTA: how much earlier outputs carried. The text's last `text_hold_back` characters
        # wait until the request ends: they may be the start of a stop string, which the final
        # text drops, and a sent delta can't be taken back.
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.num_sent_logprobs = 0
        self.text_hold_back = stop_hold_back(params.stop, params.include_stop_str_in_output)
        # text after every step: for outputs each step, or stop strings to look for; else (FINAL_ONLY
        # without stop strings) the sequence is detokenized once, when it finishes
        self.text_each_step = params.output_kind != RequestOutputKind.FINAL_ONLY or bool(params.stop)

    def completion(self) -> CompletionOutput:
        """Everything so far (copies the token list); changes nothing."""
        return CompletionOutput(index=self.index, text=self.text,
                                token_ids=list(self.token_ids),
                                cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)

    def delta_completion(self) -> CompletionOutput:
        """What no earlier delta carried; advances the sent offsets. cumulative_logprob stays the
        running total (as in vLLM)."""
        token_ids = self.token_ids[self.num_sent_tokens:]
        self.num_sent_tokens = len(self.token_ids)
        text_end = len(self.text)
        if self.finish_reason is None:
            text_end = max(self.num_sent_chars, text_end - self.text_hold_back)
        text = self.text[self.num_sent_chars:text_end]
        self.num_sent_chars = text_end
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self.num_sent_logprobs:]
            self.num_sent_logprobs = len(self.logprobs)
        return CompletionOutput(index=self.index, text=text, token_ids=token_ids,
                                cumulative_logprob=self.cumulative_logprob, logprobs=logprobs,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class RequestState:
    """A user request: its prompt and its n sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 sequences: list[SequenceState], lora_request=None, num_prompt_embeds: int = 0):
        self.request_id = request_id
        self.num_prompt_embeds = num_prompt_embeds   # a prompt of embeddings: its rows (prompt_token_ids: None)
        self.lora_request = lora_request
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sequences = sequences
        self.prompt_logprobs: list | None = None
        params = sequences[0].request.sampling_params
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.output_kind = params.output_kind
        self.num_sent_prompt_logprobs: int | None = None   # DELTA: None until an output carried them
        self.pooling_params = None   # runner="pooling": its PoolingParams (its output: a PoolingRequestOutput)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self, progressed: list[SequenceState]) -> RequestOutput | None:
        """The output of a step in which the `progressed` sequences got tokens, as `output_kind`
        asks; None when it asks for none now (FINAL_ONLY before the end). DELTA advances the
        sent offsets."""
        if self.output_kind == RequestOutputKind.DELTA:
            # n > 1: only the sequences that progressed, in index order (as vLLM)
            completions = [s.delta_completion() for s in sorted(progressed, key=lambda s: s.index)]
            prompt_lps = self._new_prompt_logprobs()
        elif self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        else:
            completions = [s.completion() for s in self.sequences]
            prompt_lps = [None] + list(self.prompt_logprobs or []) if self.wants_prompt_logprobs else None
        first = self.sequences[0].request
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, prompt_logprobs=prompt_lps,
                             outputs=completions, finished=self.finished,
                             num_cached_tokens=max(first.num_cached_tokens, 0), lora_request=self.lora_request,
                             num_prompt_embeds=self.num_prompt_embeds)

    def _new_prompt_logprobs(self) -> list | None:
        """DELTA: the prompt logprobs no earlier output carried (the first output leads with None,
        for the first prompt token), or None when there are none; advances the sent offset."""
        if not self.wants_prompt_logprobs or self.prompt_logprobs is None:
            return None
        sent = self.num_sent_prompt_logprobs
        self.num_sent_prompt_logprobs = len(self.prompt_logprobs)
        if sent is None:
            return [None] + self.prompt_logprobs
        return self.prompt_logprobs[sent:] or None


def record_logprobs(seq: SequenceState, sampled: SampledToken, tokenizer) -> None:
    seq.cumulative_logprob += sampled.logprob
    seq.step_logprobs.append(sampled.logprob)
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
    """Bring seq.text up to date; returns (stop string, truncate-to) when a stop string matched.

    Several new tokens (speculative decoding) are added one at a time while stop strings are
    asked for: the tokens after the one that completes a stop string are dropped, as they would
    never have been sampled without speculation."""
    params = seq.request.sampling_params
    new_ids = seq.token_ids[seq.num_detokenized:]
    if new_ids and _ended_on_stop_token(seq):   # its text leaves the EOS or stop token out, as vLLM's
        new_ids = new_ids[:-1]
    seq.num_dropped = 0
    # one token at a time: to find where a stop string completes, or (a sequence detokenized at its
    # end) to give the text the steps would have given
    if len(new_ids) > 1 and (params.stop or not seq.text_each_step) and seq.detokenizer is not None:
        for i in range(len(new_ids)):
            seq.num_detokenized += 1
            last = i == len(new_ids) - 1
            matched = _detokenize_ids(seq, new_ids[i:i + 1], flush=last)
            if matched is not None:
                seq.num_dropped = len(new_ids) - 1 - i
                _drop_last_tokens(seq, seq.num_dropped)
                return matched
        return None
    seq.num_detokenized = len(seq.token_ids)
    return _detokenize_ids(seq, new_ids)


def _ended_on_stop_token(seq: SequenceState) -> bool:
    """Whether the sequence finished on an EOS or stop_token_ids token (not include_stop_str_in_output): a
    text that keeps special tokens would show the EOS's, and a stop token's text is not the output's."""
    params = seq.request.sampling_params
    if seq.finish_reason != "stop" or isinstance(seq.stop_reason, str) or params.include_stop_str_in_output:
        return False
    last = seq.token_ids[-1]
    return last in (params.stop_token_ids or ()) or (not params.ignore_eos and last in seq.request.eos_token_ids)


def _drop_last_tokens(seq: SequenceState, n: int) -> None:
    """Take back the last n output tokens (their logprobs too); the request is finishing."""
    if n == 0:
        return
    del seq.token_ids[-n:]
    seq.cumulative_logprob -= sum(seq.step_logprobs[-n:])
    if seq.logprobs is not None:
        del seq.logprobs[-n:]


def _detokenize_ids(seq: SequenceState, new_ids: list[int], flush: bool = True) -> tuple[str, int] | None:
    params = seq.request.sampling_params
    if seq.detokenizer is None or not (new_ids or seq.finish_reason is not None):
        return None
    delta = seq.detokenizer.add_tokens(new_ids) if new_ids else ""
    if seq.finish_reason is not None and flush:   # a finished request's last characters
        delta += seq.detokenizer.flush()
    seq.text += delta
    if params.stop and delta and len(seq.token_ids) >= params.min_tokens:
        return check_stop_strings(seq.text, len(delta), params.stop, params.include_stop_str_in_output)
    return None


class OutputProcessor:
    """What users see of the engine core's steps (vLLM's OutputProcessor): each sequence's own
    copy of its tokens, logprobs, text and stop strings, and the RequestOutputs its output_kind
    asks for. It reads a step's results (StepResult, and the scheduler's StepUpdate) and never
    changes a core request: a stop string it finds is handed back, for the engine to finish."""

    def __init__(self, tokenizer, pooling=None):
        self.tokenizer = tokenizer
        self.pooling = pooling   # runner="pooling": engine/pooling.py's Pooling, which builds pooled outputs
        self.states: dict[str, RequestState] = {}
        self.seqs: dict[str, SequenceState] = {}   # core request id -> its sequence
        self.num_dropped_tokens = 0   # sampled after a stop string (speculative decoding), taken back
        self.num_finished = 0         # requests finished, their last output built

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        for seq in state.sequences:
            self.seqs[seq.request.request_id] = seq

    def abort(self, request_id: str) -> RequestState | None:
        """Forget a request (its outputs stop); returns its state, or None if unknown."""
        state = self.states.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self.seqs.pop(seq.request.request_id, None)
        return state

    def process(self, steps) -> tuple[list[RequestOutput], list[Request]]:
        """The outputs of `steps`, each (plan, update, result) of a step the core completed, oldest
        first; and the core requests a stop string ended (for the engine to finish as stopped)."""
        outputs, stopped = [], []
        for plan, update, result in steps:   # each step's outputs, as if they came one call each
            text_now = []
            self._record(plan, update, result, text_now)
            step_outputs, step_stopped = self._outputs(text_now)
            outputs += step_outputs
            stopped += step_stopped
        return outputs, stopped

    def _record(self, plan, update, result, text_now: list) -> None:
        """A step's tokens and logprobs into its sequences; those that need text now into `text_now`."""
        if result.prompt_logprobs:
            planned = {c.request.request_id: c.request for c in plan.chunks}
            for rid, lps in result.prompt_logprobs.items():
                seq = self.seqs.get(rid)
                # the plan's own request: an id aborted and reused while the step was in flight is another one
                state = self.states.get(seq.parent_id) if seq is not None else None   # (aborted meanwhile: None)
                if state is not None and seq.index == 0 and seq.request is planned.get(rid):
                    record_prompt_logprobs(state, lps, self.tokenizer)
        seqs, token_ids, logprobs, num_kept = self.seqs, result.token_ids, result.logprobs, update.num_kept
        for request, index in update.progressed:
            seq = seqs.get(request.request_id)
            kept = num_kept.get(request.request_id, 0) if num_kept else 0
            if seq is None or seq.request is not request or seq.finish_reason is not None:
                # aborted since, or stopped by a stop string in an earlier step's text: dropped
                self.num_dropped_tokens += 1 + kept if seq is not None and seq.request is request else 0
                continue
            if seq.logprobs is None and not kept:
                seq.token_ids.append(token_ids[index])
                seq.cumulative_logprob += logprobs[index]
            else:
                seq.step_logprobs = []
                rows = (result.rows[index], *result.kept_rows.get(request.request_id, ())[:kept])
                for row in rows:
                    token = result.token(row)
                    seq.token_ids.append(token.token_id)
                    record_logprobs(seq, token, self.tokenizer)
            if result.pooled:
                seq.pooled = result.pooled.get(request.request_id, seq.pooled)
            if seq.text_each_step:
                text_now.append(seq)
        for request, status, stop_reason in update.finished:
            seq = seqs.get(request.request_id)
            if seq is not None and seq.request is request and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = status.finish_reason, stop_reason
                if not seq.text_each_step:
                    text_now.append(seq)

    def _outputs(self, text_now: list[SequenceState]) -> tuple[list[RequestOutput], list[Request]]:
        """Detokenize, apply stop strings, build the outputs each request's output_kind asks for
        (DELTA: only the sequences that progressed, only what is new)."""
        progressed: dict[str, list[SequenceState]] = {}   # request id -> its sequences that got tokens
        stopped = []
        for seq in text_now:
            matched = detokenize(seq)
            # a stop string inside a step's kept tokens (speculative decoding) ends the request there,
            # whatever stopped it at a later token
            self.num_dropped_tokens += seq.num_dropped
            if matched is not None and (seq.finish_reason is None or seq.num_dropped):
                stop_str, truncate_to = matched
                seq.text = seq.text[:truncate_to]
                if seq.finish_reason is None:
                    stopped.append(seq.request)
                seq.finish_reason, seq.stop_reason = "stop", stop_str
            elif matched is not None:
                seq.text = seq.text[:matched[1]]
            progressed.setdefault(seq.parent_id, []).append(seq)
        outputs = []
        for request_id, seqs in progressed.items():
            state = self.states.get(request_id)
            if state is None:
                continue
            if state.pooling_params is not None:
                output = self.pooling.output(state, state.sequences[0].pooled) if state.finished else None
            else:
                output = state.output(seqs)
            if output is not None:
                outputs.append(output)
            if state.finished:
                self.abort(request_id)
                self.num_finished += 1
        return outputs, stopped
