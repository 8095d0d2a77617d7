"""OpenAI responses out of RequestOutputs: whole, or streamed as Server-Sent Events.

AsyncLLM yields cumulative outputs; a stream sends each choice's new text as a delta. When
a client goes away, Starlette cancels the response task, and the cancellation runs down
through these generators into AsyncLLM.generate, which aborts the request.
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from jaxpaged.reasoning import ReasoningParser
from jaxpaged.server import logprobs as L
from jaxpaged.server import protocol as P

logger = logging.getLogger(__name__)


def event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def prepend(first, gen):
    """The outputs of `gen` after its already-awaited `first` one; closing this closes `gen`."""
    try:
        yield first
        if not first.finished:
            async for out in gen:
                yield out
    finally:
        await gen.aclose()


async def merge(streams):
    """(prompt index, output) pairs from several requests as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                i, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                yield i, item
    finally:
        for task in tasks:   # cancelling a pump aborts its request
            task.cancel()


@dataclass
class _Cursor:
    """What a stream has already sent of one choice."""
    chars: int = 0
    tokens: int = 0
    started: bool = False
    done: bool = False
    reader: object = None   # ToolCallReader of a request with tools (it holds back partial calls)
    thought: object = None  # ReasoningStream with --reasoning-parser (it holds back a partial </think>)


class Reply:
    """One response, whole or streamed, built from the RequestOutputs of its prompts."""

    def __init__(self, server, req: P.ParsedRequest, model: str, request_id: str, params, tools=None):
        self.server, self.req, self.model, self.request_id = server, req, model, request_id
        self.created = int(time.time())
        self.n = params.n
        # a token as logprobs name it: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)
        self.decode = L.token_id_name if req.request.return_tokens_as_token_ids else server.decode_token
        self.token_ids = bool(req.request.return_token_ids)   # vLLM's return_token_ids
        self.sent_prompt_ids = False   # a chat stream sends the prompt's token ids in its first chunk
        self.cursors: dict[int, _Cursor] = {}
        # the request's tools.ToolPlan when they may be called: a reader per choice, and what a choice
        # that called reports as finish_reason
        self.tool_reader = tools.reader if tools is not None else None
        self.calls_finish_reason = tools.finish_reason if tools is not None else None
        # parallel_tool_calls false: only a first call counts ("required" is held to one by its grammar)
        self.max_calls = None if req.parallel_tool_calls else 1
        # --reasoning-parser: a chat answer's reasoning, split from its content before tool calls are read
        # (per request: chat_template_kwargs may turn thinking off); include_reasoning false drops it
        name = server.engine.args.reasoning_parser
        chat = req.kind == "chat"
        self.reasoning = ReasoningParser(name, req.request.chat_template_kwargs) if chat and name else None
        self.include_reasoning = chat and req.request.include_reasoning is not False

    def _thought(self, cursor: _Cursor, text: str, done: bool) -> tuple[str | None, str]:
        """A streamed choice's new text as (new reasoning, new content); without a parser, (None, text)."""
        if self.reasoning is None:
            return None, text
        if cursor.thought is None:
            cursor.thought = self.reasoning.stream()
        return cursor.thought.feed(text, done)

    def answer(self, text: str) -> tuple[str | None, str | None, list, object]:
        """A whole chat answer as (reasoning, content, tool calls, the reader that read them or None)."""
        thought, reasoning, content = None, None, text
        if self.reasoning is not None:
            thought = self.reasoning.stream()
            reasoning, content = (part or None for part in thought.feed(text, done=True))
        if self.tool_reader is None:
            return reasoning, content, [], None
        reader = self.tool_reader()
        extracted = reader.extract(_tool_text(reader, text, thought))
        calls = extracted.tool_calls[:self.max_calls]
        if reader.reads_whole_output:   # its content is the answer's (harmony's: without the calls' messages)
            return reasoning, extracted.content or None, calls, reader
        return reasoning, extracted.content if calls else content, calls, reader

    def answer_fragments(self, cursor: _Cursor, text: str, done: bool) -> tuple[str | None, list[dict]]:
        """A streamed chat answer with tools, `text` all of it so far: (new reasoning, the tool reader's
        content and call fragments, the calls past parallel_tool_calls' one dropped)."""
        if cursor.reader is None:
            cursor.reader = self.tool_reader()
        reasoning, _ = self._thought(cursor, text[cursor.chars:], done)
        cursor.chars = len(text)
        fragments = cursor.reader.feed(_tool_text(cursor.reader, text, cursor.thought), done)
        return reasoning, [f for f in fragments if self.max_calls is None
                           or all(t["index"] < self.max_calls for t in f.get("tool_calls", []))]

    def _reasoning_fields(self, reasoning: str | None) -> dict:
        """A message's or delta's reasoning, under vLLM's name and its earlier one."""
        return {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning and self.include_reasoning \
            else {}

    def _finish_reason(self, c, reader) -> str | None:
        return self.calls_finish_reason if reader is not None and reader.called_tools and c.finish_reason == "stop" \
            else c.finish_reason

    def _choice(self, i: int, out, c, text: str, token_ids: list, entries: list, offset: int, echo: bool,
                done: bool, started: bool = True, reasoning: str | None = None) -> dict:
        index = i * self.n + c.index   # prompt i's choices come after those of prompts 0..i-1
        finish = {"finish_reason": c.finish_reason if done else None,
                  "stop_reason": c.stop_reason if done else None}
        ids = {}   # vLLM's: return_token_ids, and a completion's prompt_logprobs
        if self.token_ids:
            ids["token_ids"] = list(token_ids)
            if self.req.kind == "completion" and (not self.req.stream or not started):
                ids["prompt_token_ids"] = None if out.prompt_token_ids is None else list(out.prompt_token_ids)
        if self.req.kind == "completion" and self.req.request.prompt_logprobs is not None:   # never streamed
            ids["prompt_logprobs"] = L.prompt_logprobs(out.prompt_logprobs or [], self.decode)
        want = self.req.logprobs is not None
        decode = self.decode
        if self.req.kind == "chat":
            lps = L.chat_logprobs(token_ids, entries, self.req.logprobs, decode) if want else None
            if self.req.stream:
                delta = {} if started else {"role": "assistant"}
                text = text if started else self.req.echo_text + text   # (echo: the first chunk's content)
                if text or not started:
                    delta["content"] = text
                if reasoning:
                    delta.update(self._reasoning_fields(reasoning))
                return {"index": index, "delta": delta, "logprobs": lps, **finish, **ids}
            reasoning, content, calls, reader = self.answer(text)
            if self.req.echo_text:
                content = self.req.echo_text + (content or "")
            message = {"role": "assistant", "content": content, **self._reasoning_fields(reasoning)}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            if reader is not None:
                finish["finish_reason"] = self._finish_reason(c, reader) if done else None
            return {"index": index, "message": message, "logprobs": lps, **finish, **ids}
        if echo:
            text = self.server.prompt_text(out) + text
            if want:
                token_ids = list(out.prompt_token_ids) + list(token_ids)
                entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + list(entries)
        lps = L.completion_logprobs(token_ids, entries, offset, decode) if want else None
        return {"index": index, "text": text, "logprobs": lps, **finish, **ids}

    def _usage(self, finals) -> dict:
        finals = [f for f in finals if f is not None]
        return P.usage(sum(f.num_prompt_tokens for f in finals),
                       sum(len(c.token_ids) for f in finals for c in f.outputs),
                       sum(f.num_cached_tokens for f in finals))

    def _usage_so_far(self, out, cursor) -> dict | None:
        """continuous_usage_stats (vLLM's): a chunk's usage is its prompt's tokens and its choice's so far."""
        if not self.req.continuous_usage:
            return None
        return P.usage(out.num_prompt_tokens, cursor.tokens, out.num_cached_tokens)

    def whole(self, finals) -> dict:
        choices = []
        for i, out in enumerate(finals):
            self.server.observe(out)
            choices += [self._choice(i, out, c, c.text, c.token_ids, c.logprobs or [], 0, self.req.echo, True)
                        for c in out.outputs]
        chat_lps = None
        if self.req.kind == "chat" and self.req.request.prompt_logprobs is not None:
            chat_lps = L.prompt_logprobs(finals[0].prompt_logprobs or [], self.decode)
        return P.response(self.req.kind, self.request_id, self.created, self.model, choices, self._usage(finals),
                          prompt_token_ids=self._chat_prompt_ids(finals[0]), prompt_logprobs=chat_lps)

    def _chat_prompt_ids(self, out, first: bool = False) -> list[int] | None:
        """A chat response's prompt token ids where return_token_ids asks (a stream: its first chunk only)."""
        if not self.token_ids or self.req.kind != "chat" or (first and self.sent_prompt_ids):
            return None
        self.sent_prompt_ids = first
        return out.prompt_token_ids

    def _tool_deltas(self, i: int, c, cursor: _Cursor) -> list[dict]:
        """A streamed choice of a request with tools: the reader's content and tool-call fragments
        (a possible call is held back until it is known), each as one chunk's choice."""
        if cursor.done:
            return []
        done = c.finish_reason is not None
        token_ids = c.token_ids[cursor.tokens:]
        entries = (c.logprobs or [])[cursor.tokens:len(c.token_ids)]
        reasoning, fragments = self.answer_fragments(cursor, c.text, done)
        if self._reasoning_fields(reasoning):
            fragments.insert(0, self._reasoning_fields(reasoning))
        if not fragments and (done or not cursor.started or (self.req.logprobs is not None and token_ids)):
            fragments = [{}]
        choices = []
        for fragment in fragments:
            delta = fragment if cursor.started else {"role": "assistant", **fragment}
            if not cursor.started and self.req.echo_text:
                delta["content"] = self.req.echo_text + (delta.get("content") or "")
            choices.append({"index": i * self.n + c.index, "delta": delta, "logprobs": None,
                            "finish_reason": None, "stop_reason": None})
            cursor.started = True
        if choices and self.req.logprobs is not None and token_ids:
            choices[0]["logprobs"] = L.chat_logprobs(token_ids, entries, self.req.logprobs, self.decode)
        if self.token_ids:
            for j, choice in enumerate(choices):
                choice["token_ids"] = list(token_ids) if j == 0 else []
        if done and choices:
            choices[-1].update(finish_reason=self._finish_reason(c, cursor.reader), stop_reason=c.stop_reason)
        cursor.chars, cursor.tokens, cursor.done = len(c.text), len(c.token_ids), done
        return choices

    def _delta(self, i: int, out, c) -> dict | None:
        cursor = self.cursors.setdefault(i * self.n + c.index, _Cursor())
        done = c.finish_reason is not None
        if cursor.done:
            return None
        # the engine's outputs never hold the possible start of a stop string (stop_hold_back)
        offset = cursor.chars
        reasoning, text = (None, c.text[offset:]) if self.reasoning is None else \
            self._thought(cursor, c.text[offset:], done)
        cursor.chars = len(c.text)   # (all of it fed: what a parser holds back is its own now)
        token_ids = c.token_ids[cursor.tokens:]
        entries = (c.logprobs or [])[cursor.tokens:len(c.token_ids)]
        wants_tokens = (self.req.logprobs is not None or self.token_ids) and token_ids
        if not (text or (reasoning and self.include_reasoning) or done or wants_tokens or not cursor.started):
            return None
        echo = self.req.echo and not cursor.started
        choice = self._choice(i, out, c, text, token_ids, entries, offset, echo, done, cursor.started, reasoning)
        cursor.tokens = len(c.token_ids)
        cursor.started, cursor.done = True, done
        return choice

    async def events(self, streams):
        finals = [None] * len(streams)
        try:
            async for i, out in merge(streams):
                if out.finished:
                    finals[i] = out
                    self.server.observe(out)
                for c in out.outputs:
                    if self.tool_reader is not None:
                        choices = self._tool_deltas(i, c, self.cursors.setdefault(i * self.n + c.index, _Cursor()))
                    else:
                        choice = self._delta(i, out, c)
                        choices = [] if choice is None else [choice]
                    usage = self._usage_so_far(out, self.cursors[i * self.n + c.index]) if choices else None
                    for choice in choices:
                        yield event(P.response(self.req.kind, self.request_id, self.created, self.model, [choice],
                                                usage, chunk=True, prompt_token_ids=self._chat_prompt_ids(out, True)))
            if self.req.include_usage:
                yield event(P.response(self.req.kind, self.request_id, self.created, self.model, [],
                                        self._usage(finals), chunk=True))
        except Exception as exc:   # headers are gone: report the failure inside the stream
            logger.exception("stream %s failed", self.request_id)
            yield event(internal_error(exc).to_dict())
        yield "data: [DONE]\n\n"


def internal_error(exc: Exception) -> P.APIError:
    return P.APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error", "server_error")


def _tool_text(reader, text: str, thought) -> str:
    """What a tool-call reader reads of an answer so far: all of it (harmony's reader, or no reasoning parser),
    else what the reasoning parser left: the text its structured outputs constrained (after </think>;
    harmony's final channel, without preambles), where a forced call's grammar wrote it."""
    return text if reader.reads_whole_output or thought is None else thought.final
