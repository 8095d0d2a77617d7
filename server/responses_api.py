"""OpenAI's Responses API, as vLLM serves it: POST /v1/responses and GET /v1/responses/{id}.

A request is read as the chat completion it amounts to (its input items as chat messages, `instructions`
as a system message, `text.format` as response_format, flat function tools as chat tools) and runs through
the same path: the chat template, tool plans, the engine, --reasoning-parser. Its answer is built as
output items: a `reasoning` item (with a reasoning parser), a `message` with `output_text`, and a
`function_call` per call; streamed, as OpenAI's typed events (response.created, response.output_item.added,
response.output_text.delta, ..., response.completed), each with its sequence_number.

With `store` (true by default) the response and its conversation stay in memory (the last MAX_STORED
of them): `previous_response_id` continues the conversation, GET /v1/responses/{id} returns it and
DELETE forgets it.
"""

import collections
import copy
import threading
import uuid

from jaxpaged.reasoning import reasoning_tags
from jaxpaged.server import protocol as P
from jaxpaged.server.openai_types import _Request
from jaxpaged.server.responses import Reply, _Cursor, event, internal_error, logger, merge
from jaxpaged.server.responses_types import (FunctionCallItem, FunctionCallOutputItem, InputMessage, ReasoningInputItem,
                                             ResponseObject, ResponsesRequest)
from jaxpaged.server.tools import plan_tools

MAX_STORED = 1000
# the chat request's fields a responses request carries under its own names
_RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}
# vLLM's fields of a chat request that a responses request may send too (sampling, structured outputs, ...)
_PASSED = (set(_Request.model_fields) | {"chat_template_kwargs", "include_reasoning"}) - set(
    ResponsesRequest.model_fields) - {"n", "max_tokens", "stream_options", "prompt_logprobs", "response_format",
                                      "return_token_ids", "return_tokens_as_token_ids"}


class ResponseStore:
    """Stored responses: id -> (the response body, the conversation up to and including its answer)."""

    def __init__(self, size: int = MAX_STORED):
        self.size = size
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None, remove: bool = False) -> tuple[dict, list[dict]]:
        with self._lock:
            found = self._items.pop(response_id, None) if remove else self._items.get(response_id)
        if found is None:
            raise P.APIError(404, f"Response with id '{response_id}' not found (only responses made with store "
                                  f"true are kept, the last {self.size} of them)", param, "not_found")
        return found


def conversation(req: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The chat messages a request continues (its previous response's) and adds (its input), without
    `instructions`, which apply to this request only."""
    messages = list(store.get(req.previous_response_id, "previous_response_id")[1]) \
        if req.previous_response_id is not None else []
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    reasoning = None   # a reasoning item goes with the assistant turn after it
    for item in items:
        if isinstance(item, ReasoningInputItem):
            reasoning = "".join(part.text for part in item.content or [])
        elif isinstance(item, InputMessage):
            text = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
            message = {"role": "system" if item.role == "developer" else item.role, "content": text}
            if item.role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":   # one answer's text and calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_body(req: ResponsesRequest, messages: list[dict]) -> dict:
    """The /v1/chat/completions body a responses request amounts to."""
    extra = req.model_extra or {}
    body = {key: value for key, value in extra.items() if key in _PASSED}
    if set(extra) - _PASSED:
        logger.warning("ignoring request fields this server does not know: %s", ", ".join(sorted(set(extra) - _PASSED)))
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    body.update(messages=messages, model=req.model, stream=req.stream, max_completion_tokens=req.max_output_tokens,
                temperature=req.temperature, top_p=req.top_p, parallel_tool_calls=req.parallel_tool_calls,
                reasoning_effort=req.reasoning.effort if req.reasoning is not None else None)
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in req.tools]
    choice = req.tool_choice
    body["tool_choice"] = choice if isinstance(choice, str) or choice is None else \
        {"type": "function", "function": {"name": choice.name}}
    form = req.text.format if req.text is not None else None
    if form is not None and form.type == "json_schema":
        spec = {"name": form.name, "schema": form.schema_, "strict": form.strict, "description": form.description}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in spec.items() if v is not None}}
    elif form is not None:
        body["response_format"] = {"type": form.type}
    return {key: value for key, value in body.items() if value is not None}


async def create_response(server, request):
    """POST /v1/responses: the response object, or its events (stream true)."""
    req = P.validate(ResponsesRequest, await server.read_json(request))
    history = conversation(req, server.responses)
    tools = None
    try:
        parsed = P.parse_chat_request(chat_body(req, history))
        tools = plan_tools(parsed, server.tool_settings)
        if tools is not None and tools.constraint is not None:
            parsed.tool_constraint = tools.constraint
        text, ids, _ = server.render_chat(parsed.messages, True, parsed.tools, parsed.request.chat_template_kwargs)

        def reply(*args):
            return ResponsesReply(*args, responses=req, history=history)
        return await server.generate(request, parsed, [({"prompt": text, "prompt_token_ids": ids}, ids)], "resp",
                                     tools, reply)
    except P.APIError as exc:   # named as this route names the field
        exc.param = _renamed(exc.param, req, tools is not None and tools.constraint is not None)
        raise


def _renamed(param: str | None, req: ResponsesRequest, forced_tools: bool) -> str | None:
    """A chat request's field as the responses request that became it names it."""
    name = (param or "").split("[")[0].split(".")[0]
    if name == "structured_outputs" and "structured_outputs" not in (req.model_extra or {}):
        return "tools" if forced_tools else "text"   # the constraint was made of the tools, or of text.format
    return _RENAMED.get(name, param)


async def stored_response(server, request) -> dict:
    """GET /v1/responses/{response_id}: a stored response; DELETE: forget it."""
    response_id = request.path_params["response_id"]
    if request.method == "DELETE":
        server.responses.get(response_id, "response_id", remove=True)
        return {"id": response_id, "object": "response", "deleted": True}
    return server.responses.get(response_id, "response_id")[0]


class ResponsesReply(Reply):
    """One response of the Responses API, whole or streamed (`whole`, `events`: Reply's interface)."""

    def __init__(self, server, req, model, request_id, params, tools=None, *, responses: ResponsesRequest,
                 history: list[dict]):
        super().__init__(server, req, model, request_id, params, tools)
        self.responses, self.history = responses, history
        self.id = "resp_" + request_id.split("-", 1)[-1]
        tokenizer = server.tokenizer
        self.end_ids = list(tokenizer.encode(reasoning_tags(self.reasoning.name)[1], add_special_tokens=False)) \
            if tokenizer and self.reasoning else None
        self.sequence = 0

    # ---- the response object ----
    def body(self, status: str, output: list[dict], final=None) -> dict:
        r = self.responses
        usage = None
        if final is not None:
            out = final.outputs[0]
            usage = {"input_tokens": len(final.prompt_token_ids),
                     "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                     "output_tokens": len(out.token_ids),
                     "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(out.token_ids)},
                     "total_tokens": len(final.prompt_token_ids) + len(out.token_ids)}
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "temperature": r.temperature, "top_p": r.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
                "tool_choice": r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump")
                else (r.tool_choice or "auto"),
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "text": r.text.model_dump(by_alias=True, exclude_none=True) if r.text else {"format": {"type": "text"}},
                "previous_response_id": r.previous_response_id, "store": r.store is not False,
                "metadata": r.metadata, "user": r.user,
                "reasoning": r.reasoning.model_dump() if r.reasoning is not None else None}
        return ResponseObject.model_validate(body).model_dump(mode="json")

    def _reasoning_tokens(self, token_ids: list[int]) -> int:
        """The output's tokens up to and including </think> (harmony's final header; all of them when it never
        ended)."""
        if not self.end_ids:
            return 0
        n = len(self.end_ids)
        ends = [i + n for i in range(len(token_ids) - n + 1) if token_ids[i:i + n] == self.end_ids]
        if ends:
            return ends[0]
        return len(token_ids) if self.reasoning.thinking else 0

    def _items(self, text: str, status: str) -> list[dict]:
        """The output items of a whole answer: reasoning, message, function calls."""
        reasoning, content, calls, _ = self.answer(text)
        items = []
        if reasoning and self.include_reasoning:
            items.append(_reasoning_item(reasoning, status))
        if content or not calls:
            items.append(_message_item(content or "", status))
        for call in calls:
            c = call.to_openai()
            items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                          "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": status})
        return items

    def _finish(self, final, output: list[dict]) -> dict:
        body = self.body(_status(final), output, final)
        if self.responses.store is not False:
            said = {"role": "assistant", "content": "".join(p["text"] for i in output if i["type"] == "message"
                                                            for p in i["content"])}
            calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"],
                                                                           "arguments": i["arguments"]}}
                     for i in output if i["type"] == "function_call"]
            if calls:
                said["tool_calls"] = calls
            self.server.responses.put(body, [*self.history, said])
        return body

    def whole(self, finals) -> dict:
        final = finals[0]
        self.server.observe(final)
        return self._finish(final, self._items(final.outputs[0].text, _status(final)))

    # ---- the stream ----
    def _event(self, kind: str, **fields) -> str:
        self.sequence += 1
        body = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\n" + event(body)

    async def events(self, streams):
        stream = _ItemStream(self)
        final = None
        yield self._event("response.created", response=self.body("in_progress", []))
        yield self._event("response.in_progress", response=self.body("in_progress", []))
        try:
            async for _, out in merge(streams):
                c = out.outputs[0]
                done = c.finish_reason is not None
                for chunk in stream.feed(c, done):
                    yield chunk
                if out.finished:
                    final = out
                    self.server.observe(out)
            status = _status(final)
            for chunk in stream.close(status):
                yield chunk
            kind = f"response.{status}"
            yield self._event(kind, response=self._finish(final, stream.items))
        except Exception as exc:   # headers are gone: report the failure inside the stream
            logger.exception("stream %s failed", self.request_id)
            yield self._event("error", **internal_error(exc).to_dict()["error"])


def _status(final) -> str:
    """A finished answer's status: incomplete when max_output_tokens cut it."""
    return "incomplete" if final.outputs[0].finish_reason == "length" else "completed"


def _message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str, status: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


class _ItemStream:
    """A streamed answer's output items: text pieces (reasoning, content) and tool-call fragments opened,
    extended and closed as OpenAI's events."""

    def __init__(self, reply: ResponsesReply):
        self.reply = reply
        self.items: list[dict] = []
        self.current: dict | None = None
        self.cursor = _Cursor()
        self.calls: dict[int, dict] = {}   # a chat tool-call index -> its function_call item

    def feed(self, c, done: bool):
        reply, cursor = self.reply, self.cursor
        if reply.tool_reader is None:
            reasoning, text = reply._thought(cursor, c.text[cursor.chars:], done)
            cursor.chars = len(c.text)
            fragments = [{"content": text}]
        else:
            reasoning, fragments = reply.answer_fragments(cursor, c.text, done)
        if reasoning and reply.include_reasoning:
            yield from self._text("reasoning", reasoning)
        for fragment in fragments:
            if fragment.get("content"):
                yield from self._text("message", fragment["content"])
            for call in fragment.get("tool_calls") or []:
                yield from self._call(call)

    def _open(self, item: dict):
        if self.current is not None:
            yield from self._close_current("completed")
        self.current = item
        self.items.append(item)
        yield self.reply._event("response.output_item.added", output_index=len(self.items) - 1,
                                item=_in_progress(item))
        if item["type"] == "message":
            yield self.reply._event("response.content_part.added", item_id=item["id"],
                                    output_index=len(self.items) - 1, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []})

    def _text(self, kind: str, piece: str):
        if self.current is None or self.current["type"] != kind:
            yield from self._open(_message_item("", "in_progress") if kind == "message"
                                  else _reasoning_item("", "in_progress"))
        part = self.current["content"][0]
        part["text"] += piece
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        yield self.reply._event(name, item_id=self.current["id"], output_index=len(self.items) - 1, content_index=0,
                                delta=piece, **extra)

    def _call(self, call: dict):
        item = self.calls.get(call["index"])
        function = call.get("function") or {}
        if item is None:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.get("id") or
                    f"call_{uuid.uuid4().hex[:24]}", "name": function.get("name") or "", "arguments": "",
                    "status": "in_progress"}
            self.calls[call["index"]] = item
            yield from self._open(item)
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            yield self.reply._event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=self.items.index(item), delta=piece)

    def _close_current(self, status: str):
        item, self.current = self.current, None
        index = self.items.index(item)
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            yield self.reply._event("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=part["text"], logprobs=[])
            yield self.reply._event("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)
        elif item["type"] == "reasoning":
            yield self.reply._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=item["content"][0]["text"])
        else:
            yield self.reply._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                    arguments=item["arguments"], name=item["name"])
        yield self.reply._event("response.output_item.done", output_index=index, item=item)

    def close(self, status: str):
        if not any(item["type"] != "reasoning" for item in self.items):   # no answer: an empty message, as whole
            yield from self._open(_message_item("", "in_progress"))
        if self.current is not None:
            yield from self._close_current(status)


def _in_progress(item: dict) -> dict:
    item = copy.deepcopy(item)
    item["status"] = "in_progress"
    return item
