"""AsyncLLM's output thread (see async_llm.py): it turns the steps the engine thread completed into
RequestOutputs (text, stop strings: each engine's OutputProcessor) and delivers them to the
requests' streams; requests a stop string ended go back to the engine thread as commands. A part of
AsyncLLM (its base class); it reads the AsyncLLM's `engine`, `_completed`, `_streams` and `_send`."""

import dataclasses
import logging
import time

from jaxpaged.engine.streams import Stream
from jaxpaged.outputs import RequestOutput

logger = logging.getLogger("jaxpaged.engine.async_llm")


class EngineRequestError(RuntimeError):
    """An internal failure while the engine processed a request (not a bad input)."""


class OutputThread:
    def _run_outputs(self) -> None:
        while True:
            item = self._completed.get()
            if item is None:
                return
            replica, steps = item
            try:
                outputs, stopped = replica.output_processor.process(steps)
            except Exception as exc:   # a bug on the output side: fail every request, as a failed step would
                logger.exception("building outputs failed; failing the %d request(s) in flight", len(self._streams))
                error = EngineRequestError(f"internal engine error: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._send(("fail", error))
                continue
            if stopped:
                self._send(("stopped", replica, stopped))
            if any(out.finished for out in outputs):
                self._publish_metrics()   # finished requests counted before their callers hear of it
            self._deliver_outputs(outputs)

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        """Output thread: each output to its request's stream (a closed caller's request is aborted)."""
        now = time.time()
        for out in outputs:
            if out.finished:
                self.engine.release(out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            # (a pooled prompt's one output: its result is its first "token")
            if stream.metrics.first_token_time is None and (not isinstance(out, RequestOutput)
                                                            or any(c.token_ids for c in out.outputs)):
                stream.metrics.first_token_time = now
            if out.finished:
                stream.metrics.finished_time = now
                self._streams.pop(out.request_id, None)
            out.metrics = dataclasses.replace(stream.metrics)
            if not self._deliver(stream, out) and not out.finished:
                self._streams.pop(out.request_id, None)
                self._send(("abort", out.request_id, None, None))

    def _deliver(self, stream: Stream, item) -> bool:
        try:
            stream.put(item)
            return True
        except RuntimeError:   # the caller's event loop is closed
            return False
