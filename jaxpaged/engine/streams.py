"""The caller's side of an AsyncLLM request: its stream (where the output thread delivers and the
caller reads), its wall-clock metrics, and the joining of DELTA outputs a slow caller finds queued."""

import asyncio
import dataclasses
import time

from jaxpaged.outputs import RequestOutput

CLOSED = object()   # queued when a request is aborted: its stream ends without a final output


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request, attached to each RequestOutput."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


class Stream:
    """Where the engine thread delivers one request's outputs and its caller reads them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.added = loop.create_future()   # the engine accepted (None) or refused (an exception)
        self.metrics = RequestMetrics(time.time())
        self.arrival_monotonic = time.monotonic()

    def put(self, item) -> None:
        """Engine thread; raises RuntimeError when the caller's event loop is closed."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def resolve_added(self, error: BaseException | None) -> None:
        def resolve():
            if not self.added.done():
                self.added.set_result(None) if error is None else self.added.set_exception(error)
        self.loop.call_soon_threadsafe(resolve)


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None = None) -> None:
    def resolve():
        if not future.done():
            future.set_result(None) if error is None else future.set_exception(error)
    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:   # the caller's loop is gone; nobody waits
        pass


def resolve_value(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
    def resolve():
        if not future.done():
            future.set_result(value)
    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:
        pass


def merge_deltas(older: RequestOutput | None, newer: RequestOutput) -> RequestOutput:
    """`newer`, a DELTA output, appended to `older` (a DELTA output or a running total): per
    completion index the text, token ids and logprobs joined, the rest from `newer`. Builds
    new lists and changes neither input, so outputs already handed out stay as they were."""
    if older is None:
        return newer
    merged = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = merged.get(c.index)
        if prev is not None:
            c = dataclasses.replace(c, text=prev.text + c.text, token_ids=prev.token_ids + c.token_ids,
                                    logprobs=None if c.logprobs is None else (prev.logprobs or []) + c.logprobs)
        merged[c.index] = c
    prompt_logprobs = older.prompt_logprobs if older.prompt_logprobs is not None else newer.prompt_logprobs
    return dataclasses.replace(newer, outputs=[merged[i] for i in sorted(merged)], prompt_logprobs=prompt_logprobs)
