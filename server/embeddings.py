"""/v1/embeddings (OpenAI's, as vLLM serves it with --runner pooling): each input's embedding, as floats
or base64 (the `openai` client asks base64 by default and decodes it)."""

import asyncio
import base64
import re
import time
import uuid

import numpy as np

from jaxpaged.engine.async_llm import EngineOverloadedError
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.server import protocol as P
from jaxpaged.server.openai_types import EmbeddingRequest
from jaxpaged.server.response_types import EmbeddingResponse


def _inputs(server, req: EmbeddingRequest) -> list[list[int]]:
    """Each input as token ids (a text tokenized as vLLM does: with the tokenizer's special tokens unless
    add_special_tokens is false)."""
    items = [req.input] if isinstance(req.input, str) or isinstance(req.input[0], int) else req.input
    special = req.add_special_tokens is not False
    return [list(server.need_tokenizer("input").encode(item, add_special_tokens=special))
            if isinstance(item, str) else list(item) for item in items]


def _vector(data: np.ndarray, encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in data]


async def create_embeddings(server, body: dict) -> dict:
    req = P.validate(EmbeddingRequest, body)
    if getattr(server.engine.engine, "pooling", None) is None:
        raise P.APIError(400, "The model does not support Embeddings API: serve it with --runner pooling", None,
                         "invalid_request")
    model = server.model(req.model)
    try:
        params = PoolingParams(req.truncate_prompt_tokens, req.dimensions)
    except ValueError as exc:
        raise _bad_request(exc) from None
    ids = _inputs(server, req)
    request_id = f"embd-{uuid.uuid4().hex}"
    lora = (server.loras or {}).get(model)
    gens = [server.engine.encode({"prompt_token_ids": tokens}, params, f"{request_id}-{i}", lora_request=lora,
                                 priority=req.priority or 0) for i, tokens in enumerate(ids)]
    try:
        outs = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
    finally:
        for g in gens:
            await g.aclose()
    error = next((o for o in outs if isinstance(o, BaseException)), None)
    if isinstance(error, ValueError):
        raise _bad_request(error)
    if isinstance(error, EngineOverloadedError):   # --max-num-waiting: come back later, not a failure
        raise P.APIError(503, str(error), None, "overloaded", "server_error", {"Retry-After": "1"})
    if error is not None:
        raise error
    data = [{"index": i, "object": "embedding", "embedding": _vector(out.outputs.data, req.encoding_format)}
            for i, out in enumerate(outs)]
    num_tokens = sum(len(out.prompt_token_ids) for out in outs)
    body = {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return EmbeddingResponse.model_validate(body).model_dump(mode="json")


def _bad_request(exc: ValueError) -> P.APIError:
    """A ValueError of the engine as a 400, `param` the request field its message names."""
    match = re.match(r"[a-z_]+", str(exc))
    name = match.group(0) if match else None
    name = "input" if name == "prompt" else name
    return P.APIError(400, str(exc), name if name in EmbeddingRequest.model_fields else None, "invalid_value")
