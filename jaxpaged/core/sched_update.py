"""After a step: the plan committed (placeholders for the tokens in flight), then the step's tokens
placed and every token stop decided in one place (vLLM's Scheduler.update_from_output). A part of
the Scheduler (its base class), apart for length; it reads and changes the scheduler's requests."""

from jaxpaged.core.request import FINISHED, Request, advance_grammar, token_stop
from jaxpaged.core.sched_output import SchedulerOutput, StepUpdate


class StepUpdates:
    def commit(self, output: SchedulerOutput) -> None:
        """The plan is on the device: advance num_computed_tokens, and give every request that
        samples a placeholder for its coming token, so the next plan can be made before this
        step's tokens are fetched (async scheduling). n > 1: the forks sampling beside their
        parent start running now, on its blocks, each with its own placeholder."""
        if output.committed:
            return
        output.committed = True
        chunks = output.chunks
        for chunk in chunks[:output.num_plain_decodes]:   # one token each, sampled
            request = chunk.request
            request.num_computed_tokens = chunk.start + 1
            request.num_placeholders += 1
        for chunk in chunks[output.num_plain_decodes:]:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_new_tokens
            request.spec_token_ids = []
            if chunk.samples:
                request.num_placeholders += 1
            if chunk.forks and not request.is_finished:
                for child in chunk.forks:
                    self.fork(request, child)
                    child.num_placeholders = 1
                request.pending_forks = []

    def update_from_output(self, output: SchedulerOutput, result) -> "StepUpdate":
        """The step's tokens arrived: place them, decide stops, finish what stopped (freeing its
        blocks). The one place where a step changes requests after it ran.

        `result` holds, per sampled request: `requests` and `token_ids` (its first token, same
        order), and `kept` (speculative decoding: request id -> the token ids kept after the first,
        accepted drafts then the recovered or bonus token). Stops: EOS (unless ignore_eos) and
        stop_token_ids once min_tokens are out, max_tokens, max_model_len, and a grammar that admits
        no more tokens (structured outputs: each token advances the request's matcher). Stop
        strings are text: the caller finds them and calls finish_request.

        Requests finished meanwhile are skipped; requests preempted after the plan was made keep
        their token."""
        self.commit(output)
        progressed, kept_counts, stopped = [], {}, []
        max_len = self.config.max_model_len
        kept = result.kept
        drafted = {c.request.request_id: c for c in output.chunks if c.num_drafts} if kept else {}
        for index, (request, token) in enumerate(zip(result.requests, result.token_ids)):
            if request.num_placeholders == 0 or request.status in FINISHED:
                continue
            request.num_placeholders -= 1
            chunk = drafted.get(request.request_id) if drafted else None
            # speculative decoding: the drafts' slots are taken back; each token kept re-adds one
            if chunk is not None and request.num_computed_tokens == chunk.start + chunk.num_new_tokens:
                request.num_computed_tokens -= chunk.num_drafts
            output_ids, all_ids = request.output_token_ids, request.all_token_ids
            output_ids.append(token)
            all_ids.append(token)
            progressed.append((request, index))
            if (token in request.stop_token_set or len(output_ids) >= request.max_tokens or len(all_ids) >= max_len
                    or request.matcher is not None or chunk is not None):
                num_kept = self._update_one(request, kept.get(request.request_id, ()), stopped)
                if num_kept:
                    kept_counts[request.request_id] = num_kept
        return StepUpdate(progressed, kept_counts, stopped)

    def _update_one(self, request: Request, kept, stopped: list) -> int:
        """update_from_output past the plain case (a stop candidate, a grammar, drafts verified):
        the tokens kept after the first, one at a time, until one stops. Returns how many it kept."""
        num_kept = 0
        for token in kept:
            if self._stop(request, stopped):
                return num_kept
            self._accept_draft(request, token)
            num_kept += 1
        self._stop(request, stopped)
        return num_kept

    def _stop(self, request: Request, stopped: list) -> bool:
        """Decide on the request's last token: finish it (True, noted in `stopped`) or let it go on."""
        stop = token_stop(request, self.config.max_model_len)
        if request.matcher is not None:
            stop = advance_grammar(request, stop)
        if stop is None:
            return False
        status, request.stop_reason = stop
        self.finish_request(request.request_id, status)
        stopped.append((request, status, request.stop_reason))
        return True

    @staticmethod
    def _accept_draft(request: Request, token: int) -> None:
        """Speculative decoding: a verified step keeps one more token of `request` (an accepted draft,
        or the token after the last one), whose predecessor's K/V the step computed."""
        request.append_output_token(token)
        request.num_computed_tokens += 1
