"""The routes of a pooling model (a server with --runner pooling), as vLLM serves them: /v1/embeddings
(OpenAI's: each input's embedding, as floats or base64, which the `openai` client asks by default and
decodes), /classify (a classifier's probabilities per input, or of one conversation), and /score and
/rerank: an embedding model's cosine similarity of the texts' embeddings, a cross-encoder's score of each
pair read as one sequence."""

import asyncio
import base64
import re
import time
import uuid

import numpy as np

from jaxpaged.engine.async_llm import EngineOverloadedError
from jaxpaged.pooling_params import PoolingParams, cosine_similarity, cross_encoder_ids, score_pairs
from jaxpaged.server import protocol as P
from jaxpaged.server.openai_types import EmbeddingRequest
from jaxpaged.server.response_types import ClassificationResponse, EmbeddingResponse, RerankResponse, ScoreResponse
from jaxpaged.server.vllm_types import ClassifyChatRequest, ClassifyRequest, RerankRequest, ScoreRequest


async def create_embeddings(server, request) -> dict:
    req = P.validate(EmbeddingRequest, await server.read_json(request))
    params = _params(req, "input", dimensions=req.dimensions, task="embed")
    model, outs = await _encode(server, req, "Embeddings", _inputs(server, req), params, "input")
    data = [{"index": i, "object": "embedding", "embedding": _vector(out.outputs.data, req.encoding_format)}
            for i, out in enumerate(outs)]
    body = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(outs)}
    return EmbeddingResponse.model_validate(body).model_dump(mode="json")


async def create_classify(server, request) -> dict:
    body = await server.read_json(request)
    if isinstance(body, dict) and "messages" in body:   # a conversation (vLLM's chat form), else inputs
        req = P.validate(ClassifyChatRequest, body)
        prompts = [server.render_chat(P.message_dicts(req.messages), req.add_generation_prompt is True)[1]]
    else:
        req = P.validate(ClassifyRequest, body)
        prompts = _inputs(server, req)
    params = _params(req, "input", use_activation=req.use_activation, task="classify")
    model, outs = await _encode(server, req, "Classification", prompts, params, "input")
    labels = server.engine.engine.pooling.labels
    data = [{"index": i, "label": labels[int(np.argmax(out.outputs.data))], "probs": [float(x) for x in
            out.outputs.data], "num_classes": len(out.outputs.data)} for i, out in enumerate(outs)]
    body = {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(outs)}
    return ClassificationResponse.model_validate(body).model_dump(mode="json")


async def create_score(server, request) -> dict:
    req = P.validate(ScoreRequest, await server.read_json(request))
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    try:
        pairs = score_pairs(len(first), len(second), ("text_1", "text_2"))
    except ValueError as exc:
        raise _bad_request(exc, req, "text_1") from None
    model, scores, outs = await _scores(server, req, "Score", first, second, pairs, "text_1")
    data = [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)]
    body = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(outs)}
    return ScoreResponse.model_validate(body).model_dump(mode="json")


async def create_rerank(server, request) -> dict:
    req = P.validate(RerankRequest, await server.read_json(request))
    pairs = [(0, i) for i in range(len(req.documents))]
    model, scores, outs = await _scores(server, req, "Rerank", [req.query], req.documents, pairs, "documents")
    results = sorted(({"index": i, "document": {"text": text}, "relevance_score": score}
                      for i, (text, score) in enumerate(zip(req.documents, scores))),
                     key=lambda r: -r["relevance_score"])
    body = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": _usage(outs)["total_tokens"]},
            "results": results[:req.top_n] if req.top_n else results}
    return RerankResponse.model_validate(body).model_dump(mode="json")


async def _scores(server, req, api: str, first: list[str], second: list[str], pairs: list[tuple], param: str):
    """(the model's name, a score per (first, second) index pair, the PoolingRequestOutputs run): a
    cross-encoder's (a classifier with one label) of each pair as one sequence, else the cosine similarity
    of an embedding model's vectors."""
    tokenizer = server.need_tokenizer(param)
    if getattr(_pooling(server, api), "num_labels", 0):
        joined = [cross_encoder_ids(tokenizer, first[i], second[j]) for i, j in pairs]
        model, outs = await _encode(server, req, api, joined, _params(req, param, task="score"), param)
        return model, [float(out.outputs.data[0]) for out in outs], outs
    ids = [list(tokenizer.encode(text)) for text in first + second]
    model, outs = await _encode(server, req, api, ids, _params(req, param, task="embed"), param)
    return model, [cosine_similarity(outs[i].outputs.data, outs[len(first) + j].outputs.data) for i, j in pairs], outs


def _inputs(server, req) -> list[list[int]]:
    """An `input` field's prompts as token ids (a text tokenized here, with BOS unless add_special_tokens is false)."""
    items = [req.input] if isinstance(req.input, str) or isinstance(req.input[0], int) else req.input
    special = req.add_special_tokens is not False
    return [list(server.need_tokenizer("input").encode(item, add_special_tokens=special)) if isinstance(item, str)
            else list(item) for item in items]


def _params(req, param: str, **fields) -> PoolingParams:
    try:
        return PoolingParams(req.truncate_prompt_tokens, **fields)
    except ValueError as exc:
        raise _bad_request(exc, req, param) from None


def _pooling(server, api: str):
    """The engine's Pooling (engine/pooling.py), or a 400 where the model does not pool."""
    pooling = getattr(server.engine.engine, "pooling", None)
    if pooling is None:
        raise P.APIError(400, f"The model does not support {api} API: serve it with --runner pooling", None,
                         "invalid_request")
    return pooling


async def _encode(server, req, api: str, prompts: list[list[int]], params: PoolingParams, param: str):
    """(the model's name, a PoolingRequestOutput per prompt), or a 400 where the model has no such task."""
    pooling = _pooling(server, api)
    if params.task not in pooling.tasks:
        raise P.APIError(400, f"The model does not support {api} API: {pooling.architecture} serves "
                              f"{', '.join(pooling.tasks)}", None, "invalid_request")
    model = server.model(req.model)
    request_id = f"pool-{uuid.uuid4().hex}"
    lora = (server.loras or {}).get(model)
    gens = [server.engine.encode({"prompt_token_ids": tokens}, params, f"{request_id}-{i}", lora_request=lora,
                                 priority=req.priority or 0) for i, tokens in enumerate(prompts)]
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
