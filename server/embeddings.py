"""The routes of a pooling model (a server with --runner pooling), as vLLM serves them: /v1/embeddings
(OpenAI's: each input's embedding, as floats or base64, which the `openai` client asks by default and
decodes), /score and /rerank (an embedding model's: the cosine similarity of the texts' embeddings)."""

import asyncio
import base64
import re
import time
import uuid

import numpy as np

from jaxpaged.engine.async_llm import EngineOverloadedError
from jaxpaged.pooling_params import PoolingParams, cosine_similarity, score_pairs
from jaxpaged.server import protocol as P
from jaxpaged.server.openai_types import EmbeddingRequest
from jaxpaged.server.response_types import EmbeddingResponse, RerankResponse, ScoreResponse
from jaxpaged.server.vllm_types import RerankRequest, ScoreRequest


async def create_embeddings(server, body: dict) -> dict:
    req = P.validate(EmbeddingRequest, body)
    items = [req.input] if isinstance(req.input, str) or isinstance(req.input[0], int) else req.input
    model, outs = await _encode(server, req, "Embeddings", items, req.dimensions, req.add_special_tokens is not False,
                                "input")
    data = [{"index": i, "object": "embedding", "embedding": _vector(out.outputs.data, req.encoding_format)}
            for i, out in enumerate(outs)]
    body = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(outs)}
    return EmbeddingResponse.model_validate(body).model_dump(mode="json")


async def create_score(server, body: dict) -> dict:
    req = P.validate(ScoreRequest, body)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    try:
        pairs = score_pairs(len(first), len(second), ("text_1", "text_2"))
    except ValueError as exc:
        raise _bad_request(exc, req, "text_1") from None
    model, outs = await _encode(server, req, "Score", first + second, None, True, "text_1")
    data = [{"index": k, "object": "score",
             "score": cosine_similarity(outs[i].outputs.data, outs[len(first) + j].outputs.data)}
            for k, (i, j) in enumerate(pairs)]
    body = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(outs)}
    return ScoreResponse.model_validate(body).model_dump(mode="json")


async def create_rerank(server, body: dict) -> dict:
    req = P.validate(RerankRequest, body)
    model, outs = await _encode(server, req, "Rerank", [req.query, *req.documents], None, True, "documents")
    query, documents = outs[0], outs[1:]
    results = sorted(({"index": i, "document": {"text": text},
                       "relevance_score": cosine_similarity(query.outputs.data, out.outputs.data)}
                      for i, (text, out) in enumerate(zip(req.documents, documents))),
                     key=lambda r: -r["relevance_score"])
    body = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": _usage(outs)["total_tokens"]},
            "results": results[:req.top_n] if req.top_n else results}
    return RerankResponse.model_validate(body).model_dump(mode="json")


async def _encode(server, req, api: str, items: list, dimensions: int | None, add_special_tokens: bool, param: str):
    """(the model's name, a PoolingRequestOutput per item: a text, tokenized here, or token ids)."""
    if getattr(server.engine.engine, "pooling", None) is None:
        raise P.APIError(400, f"The model does not support {api} API: serve it with --runner pooling", None,
                         "invalid_request")
    model = server.model(req.model)
    try:
        params = PoolingParams(req.truncate_prompt_tokens, dimensions)
    except ValueError as exc:
        raise _bad_request(exc, req, param) from None
    ids = [list(server.need_tokenizer(param).encode(item, add_special_tokens=add_special_tokens))
           if isinstance(item, str) else list(item) for item in items]
    request_id = f"pool-{uuid.uuid4().hex}"
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
        raise _bad_request(error, req, param)
    if isinstance(error, EngineOverloadedError):   # --max-num-waiting: come back later, not a failure
        raise P.APIError(503, str(error), None, "overloaded", "server_error", {"Retry-After": "1"})
    if error is not None:
        raise error
    for out in outs:
        server.observe(out)
    return model, outs


def _vector(data: np.ndarray, encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":   # the little-endian float32 values, as OpenAI's
        return base64.b64encode(np.asarray(data, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in data]


def _usage(outs) -> dict:
    num_tokens = sum(len(out.prompt_token_ids) for out in outs)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def _bad_request(exc: ValueError, req, param: str) -> P.APIError:
    """A ValueError of the engine as a 400, `param` the request field its message names (a prompt's: `param`)."""
    match = re.match(r"[a-z_][a-z_0-9]*", str(exc))   # (a field such as text_1)
    name = match.group(0) if match else None
    name = param if name == "prompt" else name
    return P.APIError(400, str(exc), name if name in type(req).model_fields else None, "invalid_value")
