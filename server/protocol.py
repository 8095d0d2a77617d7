"""The OpenAI protocol: requests in (-> ParsedRequest, SamplingParams), responses out.

The pydantic models of openai_types.py are the one definition of the wire format: requests are
validated by them and responses are passed through them. Every problem a client can
cause becomes an APIError carrying the HTTP status and the OpenAI error object; range checks
live in SamplingParams and the engine, whose ValueError messages start with the field name, so
`param` can be recovered.
"""

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from jaxpaged.engine.prompt_embeds import decode_base64
from jaxpaged.reasoning import KEEPS_SPECIAL_TOKENS, READS_SPECIAL_TOKENS
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.openai_types import (_UNSUPPORTED, ChatCompletionRequest, CompletionRequest, Message,
                                          NamedToolChoice, Tool, _Request)
from jaxpaged.server.response_types import (ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ErrorInfo,
                                            ErrorResponse)

logger = logging.getLogger(__name__)

# OpenAI's default for /v1/completions (vLLM keeps it); chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers   # HTTP headers of the error response (Retry-After of a 503)

    def to_dict(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


@dataclass
class ParsedRequest:
    """A generation request, validated. Every field is read from `request`, never from the body as
    sent: a key the route's model does not declare (in the OpenAPI document) is in model_extra only."""
    kind: str                                  # "completion" | "chat"
    request: CompletionRequest | ChatCompletionRequest
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None                       # top candidates per token; None: no logprobs
    max_tokens: int | None
    max_tokens_param: str
    echo: bool = False
    echo_text: str = ""    # chat: what `echo` puts before the answer (the last message's content, or nothing)
    prompts: list = field(default_factory=list)     # completions: str or token-id lists
    messages: list = field(default_factory=list)    # chat: [{"role", "content": str, ...}] (message_dicts)
    tools: list[dict] | None = None                 # chat: validated, in OpenAI's shape
    tool_choice: str | dict | None = None           # None: OpenAI's default ("auto" when there are tools)
    continuous_usage: bool = False                  # stream_options: usage in every chunk (vLLM's)
    parallel_tool_calls: bool = True
    # chat: structured_outputs forcing the form of tool calls (tool_choice "required" or a named function)
    tool_constraint: dict | None = None
    # chat: the output's text keeps special tokens unless the request sets skip_special_tokens (an "auto"
    # tool-call parser whose tags are special tokens: tools.plan_tools)
    keep_special_tokens: bool = False
    # chat: the reasoning parser reads special tokens (harmony's): kept whatever skip_special_tokens says
    read_special_tokens: bool = False


def plan_reasoning(req: ParsedRequest, reasoning_parser: str | None) -> None:
    """A chat answer keeps the special tokens its reasoning parser reads: harmony's whatever the request
    says, Seed-OSS' unless the request sets skip_special_tokens."""
    if req.kind != "chat":
        return
    if reasoning_parser in READS_SPECIAL_TOKENS:
        req.read_special_tokens = True
    elif reasoning_parser in KEEPS_SPECIAL_TOKENS:
        req.keep_special_tokens = True


def brief_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate(model: type[BaseModel], body: dict):
    """`body` as an instance of `model`; APIError 400 naming the first bad field."""
    present = {k: v for k, v in body.items() if v is not None}   # null always means the default
    try:
        return model.model_validate(present)
    except ValidationError as exc:
        raise _api_error(exc, model, present) from None


# pydantic's type errors in the words of a JSON API
_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
               "list_type": "a list", "dict_type": "an object", "model_type": "an object", "none_required": "null",
               "model_attributes_type": "an object"}


def _walk(loc: tuple, value) -> tuple[str, Any, int]:
    """The part of the body an error's location points at: (path, value, depth); a union
    member's tag in `loc` is no key of the body, so it is passed over."""
    path, depth = str(loc[0]), 1
    value = value[loc[0]]
    for part in loc[1:]:
        if isinstance(value, dict) and part in value:
            value, path = value[part], f"{path}.{part}"
        elif isinstance(value, list) and isinstance(part, int) and part < len(value):
            value, path = value[part], f"{path}[{part}]"
        else:
            continue
        depth += 1
    return path, value, depth


_NOTHING = object()   # a missing key's value


def _api_error(exc: ValidationError, model: type[BaseModel], body: dict) -> APIError:
    """The first bad field's errors as one 400 naming it."""
    errors = exc.errors(include_url=False)
    name = errors[0]["loc"][0]
    info = model.model_fields[name]
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if _UNSUPPORTED in extra:
        accepts = f" (it accepts only {extra[_UNSUPPORTED]})" if extra[_UNSUPPORTED] else ""
        return APIError(400, f"{name} is not supported by this server{accepts}, got {brief_repr(body[name])}", name,
                        "unsupported_parameter")
    if name not in body:
        return APIError(400, f"{name} is required", name, "missing_required_parameter")
    path, value, closest, one_place = _closest([e for e in errors if e["loc"][0] == name], body)
    first = closest[0]
    if first["type"] == "value_error":   # our validators' sentences
        return APIError(400, f"{path} {first['ctx']['error']}", name, "invalid_value")
    code = "invalid_type" if all(e["type"].endswith("_type") for e in closest) else "invalid_value"
    if first["type"] == "missing":
        detail, got = f"{path} needs {first['loc'][-1]}", _NOTHING
    elif all(e["type"] in _TYPE_WORDS for e in closest):
        detail, got = f"{path} must be {' or '.join(dict.fromkeys(_TYPE_WORDS[e['type']] for e in closest))}", value
    elif first["type"] == "union_tag_invalid":   # a content part's type (openai_types.Message.content)
        detail, got = f"{path}.type must be one of {first['ctx']['expected_tags']}", first["ctx"]["tag"]
    elif len(closest) == 1 and first["msg"].startswith("Input should be "):   # a literal's values
        detail, got = f"{path} must be {first['msg'].removeprefix('Input should be ')}", value
    else:
        detail, got, one_place = f"{path}: {'; '.join(dict.fromkeys(e['msg'] for e in closest))}", value, False
    if info.description is None:
        return APIError(400, detail + (f", got {brief_repr(got)}" if got is not _NOTHING else ""), name, code)
    message = f"{name} must be {info.description}, got {brief_repr(body[name])}"
    if one_place and path != name:   # one clear reason deeper down
        message += f" ({detail})"
    return APIError(400, message, name, code)


def _closest(errors: list[dict], body: dict) -> tuple[str, Any, list[dict], bool]:
    """Of one field's errors, those at the deepest place in the body (a union has one error per
    member; the member that got furthest is the likeliest meant): (path, value there, errors,
    whether all the deepest errors are at that one place)."""
    walked = [(*_walk(e["loc"], body), e) for e in errors]
    deepest = max(depth for _, _, depth, _ in walked)
    places = [(path, value, e) for path, value, depth, e in walked if depth == deepest]
    path, value, _ = places[0]
    return path, value, [e for p, _, e in places if p == path], all(p == path for p, _, _ in places)


def _log_unknown(request: _Request) -> None:
    if request.model_extra:   # neither OpenAI's nor ours: ignored, as vLLM does, but said in the log
        logger.warning("ignoring request fields this server does not know: %s", ", ".join(sorted(request.model_extra)))


def _common(kind: str, request: _Request, logprobs: int | None, max_tokens: int | None,
            max_tokens_param: str = "max_tokens") -> ParsedRequest:
    _log_unknown(request)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    # as vLLM: continuous_usage_stats counts only with include_usage
    continuous = include_usage and bool(request.stream_options.continuous_usage_stats)
    return ParsedRequest(kind, request, request.model, bool(request.stream), include_usage, logprobs, max_tokens,
                         max_tokens_param, continuous_usage=continuous)


def parse_completion_request(body: dict) -> ParsedRequest:
    request = validate(CompletionRequest, body)
    req = _common("completion", request, request.logprobs, request.max_tokens)
    req.echo = bool(request.echo)
    prompt = request.prompt
    if prompt is None and request.prompt_embeds is None:
        raise APIError(400, "prompt or prompt_embeds is required", "prompt", "invalid_value")
    # prompt embeddings first, then the prompts (vLLM's order): each an array [tokens, hidden]
    req.prompts = [] if request.prompt_embeds is None else prompt_embeds_arrays(request.prompt_embeds)
    if req.prompts and req.echo:
        raise APIError(400, "echo is not supported with prompt_embeds (the prompt has no text)", "echo",
                       "invalid_value")
    if prompt is not None:
        req.prompts += [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    return req


def prompt_embeds_arrays(value: str | list[str]) -> list:
    """A completion request's prompt_embeds as arrays (engine/prompt_embeds.decode_base64); 400 naming the
    field for one that is not base64 of a tensor."""
    try:
        return [decode_base64(entry) for entry in ([value] if isinstance(value, str) else value)]
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt_embeds", "invalid_value") from None


def parse_chat_request(body: dict) -> ParsedRequest:
    request = validate(ChatCompletionRequest, body)
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    req = _common("chat", request, logprobs, getattr(request, param), param)
    req.messages = message_dicts(request.messages)
    req.tools = tool_dicts(request.tools)
    choice = request.tool_choice
    req.tool_choice = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    req.parallel_tool_calls = request.parallel_tool_calls is not False
    if request.echo:
        req.echo_text = _echo_text(request, req.messages)
    effort = request.reasoning_effort
    if effort is not None:   # a template variable (gpt-oss' "Reasoning: high"), as vLLM passes it
        request.chat_template_kwargs = {**(request.chat_template_kwargs or {}), "reasoning_effort": effort}
    return req


def _echo_text(request: ChatCompletionRequest, messages: list[dict]) -> str:
    """A chat `echo`'s text, as vLLM's: the last message's content when its role is the answer's (the
    assistant's, or any when no generation prompt is added: the answer continues that message)."""
    continues = request.add_generation_prompt is False or \
        (request.add_generation_prompt is None and bool(request.continue_final_message))
    last = messages[-1]
    if not continues and last["role"] != "assistant":
        return ""
    content = last["content"]
    return content if isinstance(content, str) else "\n".join(p.get("text", "") for p in content
                                                                if p.get("type") == "text")


def message_dicts(messages: list[Message]) -> list[dict]:
    """Chat messages as plain dicts: {"role", "content": str} and tool_calls / tool_call_id / name when given."""
    return [_message_dict(m) for m in messages]


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """Tool definitions as plain dicts in OpenAI's shape, as the client sent them; None when not given."""
    return None if tools is None else [tool.model_dump(exclude_unset=True) for tool in tools]


def _message_dict(message: Message) -> dict:
    content = message.content
    if isinstance(content, list) and any(part.type in ("image_url", "image_embeds") for part in content):
        content = [part.model_dump(exclude_none=True) for part in content]   # (to chat_utils.render_chat_images)
    elif isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:   # under the names templates read: Qwen3's, and gpt-oss' (which refuses text and
        out["reasoning_content"] = reasoning   # thinking both beside tool calls: the text is kept, as it shows)
        if not (message.tool_calls and content):
            out["thinking"] = reasoning
    return out


# fields of _Request (a getattr of another name would read model_extra: a value no model checked)
_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                  "include_stop_str_in_output", "skip_special_tokens", "logit_bias", "allowed_token_ids",
                  "bad_words", "truncate_prompt_tokens")


def build_sampling_params(req: ParsedRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """SamplingParams for one prompt; the context-length rule is checked here, the rest by SamplingParams."""
    prompt_param = "messages" if req.kind == "chat" else "prompt"
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the "
                            f"{prompt_param} has {prompt_len} tokens (at most {max_model_len - 1} leave room for "
                            "one generated token)", prompt_param, "context_length_exceeded")
    room = max_model_len - prompt_len
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if req.kind == "completion" else room
    elif max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, "
                            f"{max_tokens} in the completion). Reduce the length of the {prompt_param} or "
                            f"{req.max_tokens_param}.", req.max_tokens_param, "context_length_exceeded")
    kwargs = {k: getattr(req.request, k) for k in _SAMPLING_KEYS if getattr(req.request, k) is not None}
    if req.read_special_tokens:
        kwargs["skip_special_tokens"] = False
    elif req.keep_special_tokens:
        kwargs.setdefault("skip_special_tokens", False)
    if req.request.vllm_xargs is not None:
        kwargs["extra_args"] = req.request.vllm_xargs
    structured = req.tool_constraint if req.tool_constraint is not None else _structured_outputs(req.request)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    asked = req.request.prompt_logprobs   # vLLM's field: one value serves both, so they must agree
    if asked is not None and prompt_logprobs is not None and asked != prompt_logprobs:
        raise APIError(400, f"prompt_logprobs ({asked}) must equal logprobs ({prompt_logprobs}) with echo, "
                            "which returns the prompt's logprobs too", "prompt_logprobs", "invalid_value")
    prompt_logprobs = asked if asked is not None else prompt_logprobs
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                              **kwargs)
    except ValueError as exc:
        raise bad_request(exc, req) from None


def _structured_outputs(request: _Request) -> dict | None:
    """vLLM's structured_outputs field, or OpenAI's response_format as one."""
    structured, response_format = request.structured_outputs, request.response_format
    kind = response_format.type if response_format is not None else "text"
    if kind == "text":
        return structured
    if structured is not None:
        raise APIError(400, f"give structured_outputs or response_format {{\"type\": \"{kind}\"}}, not both",
                       "response_format", "invalid_value")
    if kind == "json_object":
        return {"json_object": True}
    return {"json": response_format.json_schema.schema_ or {}}


def bad_request(exc: ValueError, req: ParsedRequest) -> APIError:
    """A ValueError of SamplingParams or the engine as a 400, `param` naming the request field."""
    match = re.match(r"[a-z_]+", str(exc))
    name = match.group(0) if match else None
    if name in ("max_tokens", "prompt_logprobs") or (name == "logprobs" and req.kind == "chat"):
        echoed = "logprobs" if req.request.prompt_logprobs is None else "prompt_logprobs"   # echo asks them too
        name = {"max_tokens": req.max_tokens_param, "prompt_logprobs": echoed, "logprobs": "top_logprobs"}[name]
    elif name == "prompt" and req.kind == "chat":
        name = "messages"
    elif name == "extra_args":   # a custom logits processor's check of its arguments
        name = "vllm_xargs"
    elif name not in ChatCompletionRequest.model_fields and name not in CompletionRequest.model_fields:
        name = None
    return APIError(400, str(exc), name, "invalid_value")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response(kind: str, request_id: str, created: int, model: str, choices: list, usage_: dict | None = None,
             chunk: bool = False, **prompt) -> dict:
    """The response (or stream chunk) as a plain dict, checked against its model; the keys given stay,
    nulls included (OpenAI sends "logprobs": null), and a chunk has "usage" only when given.
    `prompt`: a chat response's prompt_token_ids and prompt_logprobs (vLLM's), each sent when not None."""
    if kind == "completion":
        shape, obj = CompletionResponse, "text_completion"
    else:
        shape, obj = (ChatCompletionChunk, "chat.completion.chunk") if chunk else (ChatCompletionResponse,
                                                                                  "chat.completion")
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    body.update({key: value for key, value in prompt.items() if value is not None})
    try:
        return shape.model_validate(body).model_dump(mode="json", exclude_unset=True)
    except ValidationError as exc:   # the server's own mistake: not a ValueError, which would read as a 400
        raise RuntimeError(f"the server built a response that is no {shape.__name__}: {exc}") from None
