"""OpenAI request parsing (-> SamplingParams) and response pieces, as plain dicts.

Every problem a client can cause becomes an APIError carrying the HTTP status and the
OpenAI error object; the range checks themselves live in SamplingParams and the engine,
whose ValueError messages start with the field name, so `param` can be recovered.
"""

import json
import logging
import math
import re
from dataclasses import dataclass, field

from jaxpaged.outputs import Logprob
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# OpenAI's default for /v1/completions (vLLM keeps it); chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# JSON has no -inf; vLLM reports masked-out candidates with this floor instead.
_LOGPROB_FLOOR = -9999.0


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str_or_strs(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _ints(v) -> bool:
    return isinstance(v, list) and all(_int(t) for t in v)


_NUMBER, _INTEGER, _BOOL = (_num, "a number"), (_int, "an integer"), (lambda v: isinstance(v, bool), "a boolean")
_STRING, _OBJECT = (lambda v: isinstance(v, str), "a string"), (lambda v: isinstance(v, dict), "an object")
# name -> (type check, what it must be); null always means "the default"
_COMMON_FIELDS = {
    "model": _STRING, "user": _STRING,   # user: bookkeeping for OpenAI, accepted and ignored
    "max_tokens": _INTEGER, "max_completion_tokens": _INTEGER, "n": _INTEGER, "seed": _INTEGER,
    "top_k": _INTEGER, "min_tokens": _INTEGER, "temperature": _NUMBER, "top_p": _NUMBER, "min_p": _NUMBER,
    "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER,
    "stop": (_str_or_strs, "a string or a list of strings"), "stop_token_ids": (_ints, "a list of token ids"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object mapping token ids to biases"),
    "stream": _BOOL, "ignore_eos": _BOOL, "include_stop_str_in_output": _BOOL, "skip_special_tokens": _BOOL,
    "stream_options": _OBJECT,
    # vLLM's: requests share prefix-cache blocks only under the same salt (tenants never see each other's)
    "cache_salt": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    # vLLM's: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true}
    "structured_outputs": _OBJECT,
}
_COMPLETION_FIELDS = {**_COMMON_FIELDS, "echo": _BOOL, "logprobs": _INTEGER,
                      "prompt": (lambda v: True, "")}   # its shape is checked by _prompts
_CHAT_FIELDS = {**_COMMON_FIELDS, "logprobs": _BOOL, "top_logprobs": _INTEGER, "add_generation_prompt": _BOOL,
                "messages": (lambda v: True, ""),
                # OpenAI's that change no generated token, accepted and ignored: bookkeeping (metadata only
                # matters with store, which is refused), hints for a cache that is automatic here, and
                # parallel_tool_calls, which means nothing without tools (refused below)
                "metadata": _OBJECT, "prompt_cache_key": _STRING, "safety_identifier": _STRING,
                "prompt_cache_options": _OBJECT, "prompt_cache_retention": _STRING, "parallel_tool_calls": _BOOL,
                "response_format": (lambda v: isinstance(v, dict) and v.get("type") in ("text", "json_object",
                                                                                         "json_schema"),
                                    'an object with "type" one of "text", "json_object", "json_schema"')}


# OpenAI's request fields, as the `openai` package lists them (types/chat/completion_create_params.py and
# types/completion_create_params.py; a test keeps these in step with the installed one). A field of these that
# the route does not implement (is not in its _*_FIELDS) is refused with a 400 naming it, unless its value asks
# for nothing (_NO_OP_VALUES), so a client never believes JSON mode or tool calling was honoured. A field in
# neither list is ignored with a warning in the log, as vLLM does. Tools come first: they are what to name.
OPENAI_CHAT_FIELDS = (
    "tools", "functions", "tool_choice", "function_call", "parallel_tool_calls", "response_format", "audio",
    "modalities", "prediction", "reasoning_effort", "verbosity", "service_tier", "store", "moderation",
    "web_search_options", "messages", "model", "frequency_penalty", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "n", "presence_penalty", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "seed", "stop", "stream",
    "stream_options", "temperature", "top_logprobs", "top_p", "user")
OPENAI_COMPLETION_FIELDS = (
    "best_of", "suffix", "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user")
# unimplemented field -> (does this value ask for nothing, the values that do); null always does. Clients
# other than the official one (which sends only what the user set) send such defaults.
_NO_OP_VALUES = {
    "tools": (lambda v, body: v == [], "[]"),
    "functions": (lambda v, body: v == [], "[]"),
    # "auto" picks among no tools: any tools were refused already
    "tool_choice": (lambda v, body: v in ("none", "auto"), '"none" or "auto" without tools'),
    "function_call": (lambda v, body: v in ("none", "auto"), '"none" or "auto" without functions'),
    "response_format": (lambda v, body: isinstance(v, dict) and v.get("type") == "text", '{"type": "text"}'),
    "modalities": (lambda v, body: isinstance(v, list) and all(m == "text" for m in v), '["text"]'),
    "reasoning_effort": (lambda v, body: v == "none", '"none"'),
    "verbosity": (lambda v, body: v == "medium", '"medium" (the default)'),
    "service_tier": (lambda v, body: v in ("auto", "default"), '"auto" or "default"'),
    "store": (lambda v, body: v is False, "false"),
    "best_of": (lambda v, body: _int(v) and v in (1, body.get("n") or 1), "1 or the value of n"),
    "suffix": (lambda v, body: v == "", '""'),
}
_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                  "include_stop_str_in_output", "skip_special_tokens", "logit_bias")


@dataclass
class ParsedRequest:
    kind: str                                  # "completion" | "chat"
    body: dict
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None                       # top candidates per token; None: no logprobs
    max_tokens: int | None
    max_tokens_param: str
    echo: bool = False
    prompts: list = field(default_factory=list)     # completions: str or token-id lists
    messages: list = field(default_factory=list)    # chat: [{"role", "content": str}]


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _check_types(body: dict, fields: dict, openai_fields: tuple, required: str) -> None:
    if body.get(required) is None:
        raise APIError(400, f"{required} is required", required, "missing_required_parameter")
    for name, (ok, what) in fields.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise APIError(400, f"{name} must be {what}, got {brief_repr(value)}", name, "invalid_type")
    for name in openai_fields:
        value = body.get(name)
        if name in fields or value is None:
            continue
        is_no_op, no_ops = _NO_OP_VALUES.get(name, (None, None))
        if is_no_op is None or not is_no_op(value, body):
            accepts = f" (it accepts only {no_ops})" if no_ops else ""
            raise APIError(400, f"{name} is not supported by this server{accepts}, got {brief_repr(value)}",
                           name, "unsupported_parameter")
    unknown = sorted(set(body) - set(fields) - set(openai_fields))
    if unknown:   # neither OpenAI's nor ours: ignored, as vLLM does, but said in the log
        logger.warning("ignoring request fields this server does not know: %s", ", ".join(unknown))
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options",
                           "invalid_value")
        if not isinstance(options.get("include_usage", False), bool):
            raise APIError(400, f"stream_options.include_usage must be a boolean, got "
                                f"{brief_repr(options['include_usage'])}", "stream_options", "invalid_type")


def brief_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _common(kind: str, body: dict, logprobs: int | None) -> ParsedRequest:
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return ParsedRequest(kind, body, body.get("model"), bool(body.get("stream")),
                         bool((body.get("stream_options") or {}).get("include_usage")), logprobs,
                         body.get(param), param)


def parse_completion_request(body: dict) -> ParsedRequest:
    _check_types(body, _COMPLETION_FIELDS, OPENAI_COMPLETION_FIELDS, "prompt")
    req = _common("completion", body, body.get("logprobs"))
    req.echo = bool(body.get("echo"))
    req.prompts = _prompts(body["prompt"])
    return req


def _prompts(value) -> list:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or all(_ints(p) and p for p in value):
            return list(value)
        if _ints(value):
            return [value]
    raise APIError(400, "prompt must be a string, a non-empty list of strings, a list of token ids or a list "
                        f"of token-id lists, got {brief_repr(value)}", "prompt", "invalid_type")


def parse_chat_request(body: dict) -> ParsedRequest:
    _check_types(body, _CHAT_FIELDS, OPENAI_CHAT_FIELDS, "messages")
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs", "invalid_value")
    req = _common("chat", body, (top or 0) if body.get("logprobs") else None)
    req.messages = parse_messages(body["messages"])
    return req


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages must be a non-empty list of messages, got {brief_repr(messages)}",
                       "messages", "invalid_type")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role, got {brief_repr(message)}",
                           "messages", "invalid_type")
        content = message.get("content")
        if isinstance(content, list):   # content parts: only text ones can be served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                    f"{brief_repr(content)}", "messages", "invalid_value")
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts, got "
                                f"{brief_repr(content)}", "messages", "invalid_type")
        parsed.append({"role": message["role"], "content": content or ""})
    return parsed


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
    elif _int(max_tokens) and max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, "
                            f"{max_tokens} in the completion). Reduce the length of the {prompt_param} or "
                            f"{req.max_tokens_param}.", req.max_tokens_param, "context_length_exceeded")
    kwargs = {k: req.body[k] for k in _SAMPLING_KEYS if req.body.get(k) is not None}
    structured = _structured_outputs(req.body)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                              **kwargs)
    except ValueError as exc:
        raise bad_request(exc, req) from None


def _structured_outputs(body: dict) -> dict | None:
    """vLLM's structured_outputs field, or OpenAI's response_format (chat) as one."""
    structured, response_format = body.get("structured_outputs"), body.get("response_format")
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return structured
    if structured is not None:
        raise APIError(400, f"give structured_outputs or response_format {{\"type\": \"{kind}\"}}, not both",
                       "response_format", "invalid_value")
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise APIError(400, 'response_format.json_schema must be an object {"name", "schema", "strict"}, got '
                            f"{brief_repr(spec)}", "response_format", "invalid_type")
    return {"json": spec.get("schema", {})}


def bad_request(exc: ValueError, req: ParsedRequest) -> APIError:
    """A ValueError of SamplingParams or the engine as a 400, `param` naming the request field."""
    match = re.match(r"[a-z_]+", str(exc))
    name = match.group(0) if match else None
    if name in ("max_tokens", "prompt_logprobs") or (name == "logprobs" and req.kind == "chat"):
        name = {"max_tokens": req.max_tokens_param, "prompt_logprobs": "logprobs", "logprobs": "top_logprobs"}[name]
    elif name == "prompt" and req.kind == "chat":
        name = "messages"
    elif name not in _CHAT_FIELDS and name not in _COMPLETION_FIELDS:
        name = None
    return APIError(400, str(exc), name, "invalid_value")


# ---- response pieces -------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def _token_text(token_id: int, entry: dict[int, Logprob] | None, decode) -> str:
    lp = entry.get(token_id) if entry else None
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode(token_id)


def _best(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def completion_logprobs(token_ids: list[int], entries: list, text_offset: int, decode) -> dict:
    """/v1/completions format; an entry of None (the first prompt token) has no logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(token_id, entry, decode)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(entry[token_id].logprob) if entry else None)
        top = None
        if entry:
            top = {}
            for candidate, lp in _best(entry):   # two ids can read the same ("\ufffd"): keep the likelier
                top.setdefault(_token_text(candidate, entry, decode), _finite(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], entries: list, top_n: int, decode) -> dict:
    """/v1/chat/completions format: one object per token with its `top_n` best candidates."""
    def item(token_id, lp: Logprob, entry) -> dict:
        text = _token_text(token_id, entry, decode)
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, entry[t], entry),
                         "top_logprobs": [item(c, lp, entry) for c, lp in _best(entry)[:top_n]]}
                        for t, entry in zip(token_ids, entries)]}


def response(kind: str, request_id: str, created: int, model: str, choices: list, usage_: dict | None = None,
             chunk: bool = False) -> dict:
    obj = ("text_completion" if kind == "completion" else
           "chat.completion.chunk" if chunk else "chat.completion")
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body
