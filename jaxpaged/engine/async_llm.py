"""AsyncLLM: the engine loop in one background thread, outputs built in another, each request an
async stream.

    coroutines --(commands: add / abort, a locked list)--> engine thread: commands, then step()
    engine thread --(completed steps, a queue)--> output thread: text, stop strings, RequestOutputs
    output thread --(loop.call_soon_threadsafe)--> the request's asyncio.Queue --> generate()
    output thread --(commands: requests a stop string ended)--> engine thread

Only the engine thread touches the scheduler and the runner (JAX dispatch is not thread-safe, and
a single owner keeps the step free of locks); only the output thread touches the sequences'
text, detokenizers and logprobs (each engine's OutputProcessor), so a step's launch never waits
for text. The two share the GIL: the output thread runs while the engine thread waits on the
device. Callers get a separate copy of the tokenizer.
"""

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_outputs import EngineRequestError, OutputThread
from jaxpaged.engine.llm_engine import LLMEngine, StepFailedError
from jaxpaged.engine.multimodal import prepare_images
from jaxpaged.engine.research import AsyncResearchMixin
from jaxpaged.engine.streams import CLOSED, RequestMetrics, Stream, merge_deltas, resolve, resolve_value
from jaxpaged.outputs import PoolingRequestOutput, RequestOutput
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLM", "EngineOverloadedError", "EngineRequestError", "RequestMetrics"]

logger = logging.getLogger(__name__)

class EngineOverloadedError(RuntimeError):
    """A request refused because `max_num_waiting` requests already wait for a seat in the batch."""


def _check_max_num_waiting(value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"max_num_waiting must be an integer >= 1 or None, got {value!r}")


class AsyncLLM(AsyncResearchMixin, OutputThread):
    """Serve many concurrent callers from one continuously batched engine."""

    def __init__(self, engine: LLMEngine, max_num_waiting: int | None = None):
        """`max_num_waiting`: refuse a new request (EngineOverloadedError) while this many wait to
        be scheduled; None: queue without bound."""
        _check_max_num_waiting(max_num_waiting)
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self._saturated = False   # engine thread only: the last step left requests waiting
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.num_blocks = engine.num_blocks
        self.block_size = engine.args.block_size
        self.model_config = engine.model_config
        self.args = engine.args
        self._tokenizer = _copy_tokenizer(engine.tokenizer)
        self._cond = threading.Condition()
        self._commands: list[tuple] = []      # guarded by _cond
        self._stopping = False                # guarded by _cond
        self._closed = False                  # guarded by _cond: no command will ever be read again
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._metrics = engine.get_metrics()  # replaced (never mutated) by the engine thread
        self._metrics_per_rank = engine.get_metrics_per_rank()   # likewise: one dict per data-parallel replica
        self._completed: queue.SimpleQueue = queue.SimpleQueue()   # (replica, steps); None: stop
        self._output_thread = threading.Thread(target=self._run_outputs, name="jaxpaged-outputs", daemon=True)
        self._output_thread.start()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, use_tqdm: bool = True,
                         max_num_waiting: int | None = None) -> "AsyncLLM":
        from jaxpaged.engine.dp_engine import make_engine
        _check_max_num_waiting(max_num_waiting)
        return cls(make_engine(args, use_tqdm=use_tqdm), max_num_waiting)

    # ---- the caller's side ---------------------------------------------------------------
    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, output_kind: str = "delta",
                       lora_request=None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs of one request as tokens arrive, until it finishes.

        output_kind="delta" (default): each output's completions hold only the text, token ids
        and logprobs that are new since the previous one (the last carries finish_reason; with
        n > 1, only the completions that progressed, by `index`); "cumulative": everything so
        far, as vLLM's CUMULATIVE kind. This argument decides: `sampling_params.output_kind` is
        ignored. Either way the engine sends deltas (nothing is copied per step on its thread)
        and this stream joins them. While a stop string may still complete, its possible start
        is held back from the text until the next output.

        `lora_request`: the LoRARequest the request runs with (the engine needs enable_lora).
        `priority`: with scheduling_policy="priority", the lower, the sooner (else it must be 0).
        Bad input raises ValueError before any output; a full queue (max_num_waiting) raises
        EngineOverloadedError. An internal failure raises EngineRequestError in this request only.
        Closing or cancelling the consumer aborts the request; an abort from elsewhere ends the
        stream without a finished output.
        """
        if not self.is_running:
            raise RuntimeError("AsyncLLM is shut down")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if output_kind not in ("delta", "cumulative"):
            raise ValueError(f"output_kind must be 'delta' or 'cumulative', got {output_kind!r}")
        params = (sampling_params or SamplingParams()).clone()   # the engine thread owns this copy
        params.output_kind = RequestOutputKind.DELTA
        prompt = await prepare_images(self.engine, prompt)   # images read and processed off the engine's thread
        # (aclosing: a consumer that stops closes the request's generator at once, which aborts it)
        async with contextlib.aclosing(self._request(request_id, (prompt, params, lora_request, priority, None),
                                                     output_kind)) as outputs:
            async for item in outputs:
                yield item

    async def encode(self, prompt: str | list[int] | dict, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, lora_request=None,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """Pool one prompt (an engine with runner="pooling"): yields its one PoolingRequestOutput.
        Errors as generate's."""
        if not self.is_running:
            raise RuntimeError("AsyncLLM is shut down")
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        async with contextlib.aclosing(self._request(request_id, (prompt, None, lora_request, priority,
                                                                  pooling_params or PoolingParams()),
                                                     "delta")) as outputs:
            async for item in outputs:
                yield item

    async def _request(self, request_id: str | None, inputs: tuple, output_kind: str):
        """One request's outputs (inputs: prompt, SamplingParams, LoRA, priority, PoolingParams)."""
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        total: RequestOutput | None = None   # "cumulative": the deltas joined so far
        stream = Stream(asyncio.get_running_loop())
        if not self._send(("add", stream, request_id, *inputs)):
            raise RuntimeError("AsyncLLM is shut down")
        finished = False
        try:
            await stream.added
            while not finished:
                item = await stream.queue.get()
                # A slow consumer gets the deltas queued meanwhile as one (an abort or error wins).
                while isinstance(item, RequestOutput) and not stream.queue.empty():
                    newer = stream.queue.get_nowait()
                    item = merge_deltas(item, newer) if isinstance(newer, RequestOutput) else newer
                if item is CLOSED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if output_kind == "cumulative":
                    item = total = merge_deltas(total, item)
                yield item
        finally:
            if not finished:
                self._send(("abort", request_id, stream, None))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its blocks are free (unknown ids are ignored)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if self._send(("abort", str(request_id), None, (loop, done))):
            await done

    # ---- research loops and sleep mode (run on the engine thread, between steps) --------------
    async def call(self, fn):
        """fn(engine) on the engine thread, between two steps; returns its result (or raises its error)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if not self._send(("call", fn, (loop, done))):
            raise RuntimeError("AsyncLLM is shut down")
        return await done

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's: LLMEngine.collective_rpc on each replica, on the engine thread between two steps."""
        return await self.call(lambda engine: [e.collective_rpc(method, args, kwargs) for e in engine.replicas()])

    def get_metrics(self) -> dict[str, float]:
        """The engine's `jaxpaged:*` counters and gauges as of its last step or command (summed over
        data-parallel replicas; KV cache usage averaged)."""
        return dict(self._metrics)

    def get_metrics_per_rank(self) -> list[dict[str, float]]:
        """The same, one dict per data-parallel replica."""
        return [dict(m) for m in self._metrics_per_rank]

    def get_tokenizer(self):
        """A tokenizer for the caller's thread (a copy: the engine thread decodes with its own)."""
        return self._tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; requests still in flight end with RuntimeError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _send(self, command: tuple) -> bool:
        """Queue a command for the engine thread; False once that thread has stopped for good."""
        with self._cond:
            if self._closed:
                return False
            self._commands.append(command)
            self._cond.notify()
            return True

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:   # a bug in the loop itself: nobody may be left waiting forever
            logger.exception("the engine loop died")
            with self._cond:
                self._stopping = True
        try:
            self.engine.shutdown()   # several hosts: from the thread that sent every step, release the followers
        except Exception:
            logger.exception("releasing the other hosts failed")
        self._completed.put(None)   # the output thread builds what completed, then stops
        self._output_thread.join(timeout=60)
        self._fail_requests(RuntimeError("AsyncLLM was shut down while the request was running"))
        with self._cond:   # commands that raced with shutdown; none can come after this
            pending, self._commands = self._commands, []
            self._closed = True
        for command in pending:   # each answered "shut down"; one failing (a closed caller) stops no other
            try:
                self._apply(command, stopping=True)
            except Exception:
                logger.exception("answering a command at shutdown failed")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self._can_step()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for i, command in enumerate(commands):
                try:
                    self._apply(command, stopping)
                except BaseException:   # the loop dies: _run answers this command and the rest
                    with self._cond:
                        self._commands[:0] = commands[i:]
                    raise
            if stopping:
                return
            if self._can_step():
                self._step()

    def _can_step(self) -> bool:
        """Requests to run (or steps in flight), and no replica paused (pause_generation) or asleep."""
        return self.engine.has_work() and not any(r.paused or r.is_sleeping() for r in self.engine.replicas())

    def _apply(self, command: tuple, stopping: bool) -> None:
        if command[0] == "stopped":   # the output thread found stop strings
            _, replica, requests = command
            replica.finish_stopped(requests)
            return
        if command[0] == "fail":      # the output thread failed: every request fails
            self._fail_requests(command[1])
            return
        if command[0] == "call":
            _, fn, (loop, future) = command
            if stopping:
                resolve(loop, future, RuntimeError("AsyncLLM is shut down"))
                return
            try:
                result = fn(self.engine)
            except Exception as exc:   # the caller's error (a ValueError: bad weights, requests unfinished)
                resolve(loop, future, exc)
            else:
                resolve_value(loop, future, result)
            self._publish_metrics()
            return
        if command[0] == "add":
            _, stream, request_id, prompt, params, lora_request, priority, pooling_params = command
            if stopping:
                stream.resolve_added(RuntimeError("AsyncLLM is shut down"))
                return
            queued = self._num_queued() if self.max_num_waiting is not None else 0
            if self.max_num_waiting is not None and queued >= self.max_num_waiting:
                stream.resolve_added(EngineOverloadedError(
                    f"the server is overloaded: {queued} requests wait for a seat in the batch "
                    f"(max_num_waiting {self.max_num_waiting}); retry later"))
                return
            try:
                self.engine.add_request(request_id, prompt, params, arrival_time=stream.arrival_monotonic,
                                        lora_request=lora_request, priority=priority,
                                        pooling_params=pooling_params)
            except Exception as exc:   # ValueError: bad input; anything else: one request's failure
                stream.resolve_added(exc)
                return
            self._streams[request_id] = stream
            self._publish_metrics()
            stream.resolve_added(None)
        else:
            _, request_id, owner, ack = command
            stream = self._streams.get(request_id)
            # A caller that goes away aborts only its own request, never a namesake's.
            if owner is None or stream is owner:
                if stream is not None:
                    del self._streams[request_id]
                    self._deliver(stream, CLOSED)
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("aborting request %s failed", request_id)
                self._publish_metrics()
            if ack is not None:
                resolve(*ack)

    def _num_queued(self) -> int:
        """Requests that wait for a seat in the batch and will not get one at the next step.

        While the last step left requests waiting (seats or KV blocks ran out), every waiting or
        swapped-out request counts; otherwise those beyond the free seats. Counted on the engine
        thread, where adds are applied one at a time, so a burst is counted exactly."""
        metrics = self.engine.get_metrics()
        waiting = int(metrics["jaxpaged:num_requests_waiting"] + metrics["jaxpaged:num_requests_swapped"])
        if self._saturated:
            return waiting
        seats = self.args.max_num_seqs * len(self.engine.replicas())
        return max(0, waiting - max(0, seats - int(metrics["jaxpaged:num_requests_running"])))

    def _step(self) -> None:
        try:
            self.engine.step(defer_outputs=True)   # outputs built from take_completed() on the output thread
        except StepFailedError as exc:
            # The step ran its whole batch, so the failure can't be pinned on one request: the
            # engine aborted that step's requests; they fail, every other request keeps going.
            logger.exception("engine step failed; failing its %d request(s)", len(exc.request_ids))
            error = EngineRequestError(f"internal engine error: {exc.__cause__ or exc}")
            error.__cause__ = exc
            self._hand_over()   # the steps completed before it (their requests' outputs)
            self._fail_requests(error, exc.request_ids)
            return
        except Exception as exc:   # outside any step (a bug): the engine's state is unknown, fail all
            logger.exception("engine step failed; failing the %d request(s) in flight", len(self._streams))
            error = EngineRequestError(f"internal engine error: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._fail_requests(error)
            return
        self._hand_over()
        self._publish_metrics()
        # the scheduler just planned: what it left waiting could not be taken (seats or KV blocks)
        self._saturated = self._metrics["jaxpaged:num_requests_waiting"] + \
            self._metrics["jaxpaged:num_requests_swapped"] > 0

    def _hand_over(self) -> None:
        """Engine thread: the steps each replica completed, to the output thread."""
        for replica in self.engine.replicas():
            steps = replica.take_completed()
            if steps:
                self._completed.put((replica, steps))

    def _fail_requests(self, error: BaseException, request_ids: list[str] | None = None) -> None:
        """Abort and fail the given requests (default: every request in flight)."""
        for request_id in list(self._streams) if request_ids is None else request_ids:
            stream = self._streams.pop(request_id, None)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
            if stream is not None:
                with contextlib.suppress(RuntimeError):   # its add was cut short: the error follows in the queue
                    stream.resolve_added(None)
                self._deliver(stream, error)
        self._publish_metrics()

    def _publish_metrics(self) -> None:
        try:
            self._metrics = self.engine.get_metrics()
            self._metrics_per_rank = self.engine.get_metrics_per_rank()
        except Exception:
            logger.exception("reading engine metrics failed")


def _copy_tokenizer(tokenizer):
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:   # an uncopyable tokenizer: share it (fine for the usual fast tokenizers)
        logger.warning("could not copy the tokenizer; callers share the engine's")
        return tokenizer

