"""Request bodies: read within a size bound and parsed as strict JSON, for every POST route.

All of it happens before a body reaches a pydantic model, most of it before json.loads: a body
that is too big, too deep or not strict JSON costs the server little and gets a 4xx (413 for
size, 400 otherwise), never a RecursionError or a value that code after the models trips on.
"""

import json
import re

import numpy as np
from starlette.requests import Request

from jaxpaged.server.protocol import APIError

# json.loads and what walks the parsed body (pydantic, the schema compiler) recurse once per level
# (Python's limit is ~1000): a few thousand brackets would end in a RecursionError. A request's own structure is at most 5
# deep (body, tools, tool, function, parameters); what is left holds a JSON schema nesting objects
# ~29 deep (each level is "properties" and the object), far beyond a real tool's or response_format's.
MAX_JSON_DEPTH = 64
# --max-request-body-bytes by default: a context of token ids ("123456, " is 8 bytes a token) or of
# escaped text fits 32 bytes a token several times over; 1 MiB keeps short contexts from being cramped.
BODY_BYTES_PER_TOKEN = 32
MIN_DEFAULT_BODY_BYTES = 1 << 20

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)   # a JSON string, escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")   # lone surrogates only come from \u escapes


IMAGE_BODY_BYTES = 32 << 20


def default_max_request_body_bytes(max_model_len: int, embeds_width: int = 0, images: bool = False) -> int:
    """`embeds_width` (--enable-prompt-embeds: the hidden size): a context of fp32 prompt embeddings in base64
    (4 bytes a value, 4/3 of that in base64) fits too, with room for a torch.save file's own bytes. `images`
    (a vision-language model): 32 MiB more, for images sent as data URLs."""
    per_token = BODY_BYTES_PER_TOKEN + (embeds_width * 4 * 4 + 2) // 3
    return max(MIN_DEFAULT_BODY_BYTES, per_token * max_model_len + (64 << 10 if embeds_width else 0)) + \
        (IMAGE_BODY_BYTES if images else 0)


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object; APIError (400, or 413 above `max_bytes`) for anything else.
    A body over the bound is refused on its Content-Length, or, sent chunked, as soon as the
    bytes read pass it: the app reads no further."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not (media_type.startswith("application/")
                                                                 and media_type.endswith("+json")):
        raise APIError(400, f"Content-Type must be application/json, got {content_type!r}", None,
                       "invalid_content_type")
    too_large = APIError(413, f"request body is larger than {max_bytes} bytes (the server's "
                              "--max-request-body-bytes)", None, "request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of `raw` nest, brackets inside strings not counted; linear
    in its length, with no recursion. Malformed JSON gets a number too (json.loads then refuses it)."""
    codes = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


def parse_json(raw: bytes) -> dict:
    """`raw` as a JSON object, strictly: UTF-8, at most MAX_JSON_DEPTH deep, no NaN or Infinity,
    no key twice in one object, no lone surrogate (\\ud800) in a string. APIError 400 otherwise,
    naming the top-level field that holds the fault when there is one."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(400, f"request body nests arrays and objects more than {MAX_JSON_DEPTH} deep (the "
                            "server's limit)", None, "invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: {exc}", None, "invalid_json") from None
    if not text.strip():
        raise APIError(400, "request body is empty: send a JSON object", None, "invalid_json")
    faults = _Faults()
    try:
        body = json.loads(text, parse_constant=faults.constant, object_pairs_hook=faults.object)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    if faults.first is None and _SURROGATE_ESCAPE.search(text):
        faults.first = (_lone_surrogate, "a string holds a lone UTF-16 surrogate, which is no character", None)
    if faults.first is None:
        return body
    is_fault, detail, key = faults.first
    if is_fault(body):   # a key given twice at the top: that field
        raise APIError(400, f"request body is not valid JSON: {detail}", key, "invalid_json")
    param = next((k for k, v in body.items() if is_fault(k) or _holds(v, is_fault)), None)
    if param is None and is_fault is _lone_surrogate:   # the escapes were pairs (emoji): characters
        return body
    where = f" (in {param})" if param is not None and not is_fault(param) else ""
    raise APIError(400, f"request body is not valid JSON: {detail}{where}", param, "invalid_json")


class _Faults:
    """json.loads' hooks. They note the first value strict JSON refuses instead of raising: which
    field holds it is known only once the whole body is parsed. `first`: (a test that is true of
    the refused value, the reason in words, the key given twice or None)."""

    def __init__(self):
        self.first = None

    def constant(self, name: str):
        marker = object()   # stands in the body for the literal, for the test to find
        if self.first is None:
            self.first = (lambda value: value is marker, f"{name} is not a JSON number", None)
        return marker

    def object(self, pairs: list) -> dict:
        obj = dict(pairs)
        if len(obj) < len(pairs) and self.first is None:
            seen = set()
            key = next(k for k, _ in pairs if k in seen or seen.add(k))
            self.first = (lambda value: value is obj, f"the key {key!r} is given twice in one object", key)
        return obj


def _lone_surrogate(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _holds(value, is_fault) -> bool:
    if is_fault(value):
        return True
    if isinstance(value, dict):
        return any(is_fault(k) or _holds(v, is_fault) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds(v, is_fault) for v in value)
    return False
