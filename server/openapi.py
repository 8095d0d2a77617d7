"""The server's OpenAPI 3.1 document, generated from the protocol's pydantic models."""

from pydantic.json_schema import models_json_schema

import jaxpaged
from jaxpaged.server.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from jaxpaged.server.response_types import (ChatCompletionChunk, ChatCompletionResponse, ClassificationResponse,
                                            CompletionResponse, EmbeddingResponse, ErrorResponse, ModelList,
                                            RerankResponse, ScoreResponse)
from jaxpaged.server.responses_types import ResponseObject, ResponsesRequest
from jaxpaged.server.vllm_types import ClassifyChatRequest, ClassifyRequest, RerankRequest, ScoreRequest

_REF = "#/components/schemas/{model}"


def openapi_schema() -> dict:
    """The OpenAPI 3.1 document of the /v1 routes, generated from the models above."""
    models = [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
              (CompletionResponse, "serialization"), (ChatCompletionResponse, "serialization"),
              (ChatCompletionChunk, "serialization"), (ModelList, "serialization"), (ErrorResponse, "serialization"),
              (EmbeddingRequest, "validation"), (EmbeddingResponse, "serialization"), (ScoreRequest, "validation"),
              (ScoreResponse, "serialization"), (RerankRequest, "validation"), (RerankResponse, "serialization"),
              (ClassifyRequest, "validation"), (ClassifyChatRequest, "validation"),
              (ClassificationResponse, "serialization"), (ResponsesRequest, "validation"),
              (ResponseObject, "serialization")]
    refs, defs = models_json_schema(models, ref_template=_REF)

    def ref(model) -> dict:
        return refs[(model, "validation" if model.__name__.endswith("Request") else "serialization")]

    def post(request, ok, chunk, summary: str) -> dict:
        """A POST route; `request`: its body's model, or a tuple of the models a body may be."""
        body = {"anyOf": [ref(r) for r in request]} if isinstance(request, tuple) else ref(request)
        content = {"application/json": {"schema": ref(ok)}}
        if chunk is not None:
            content["text/event-stream"] = {"schema": ref(chunk)}
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {"description": "the response; with stream true, Server-Sent Events of chunks, then "
                                       "`data: [DONE]`",
                        "content": content},
                "400": {"description": "a bad request; `param` names the field",
                        "content": {"application/json": {"schema": ref(ErrorResponse)}}},
                "413": {"description": "a body above the server's --max-request-body-bytes, refused unread",
                        "content": {"application/json": {"schema": ref(ErrorResponse)}}}}}}

    models = {"200": {"description": "the served model names",
                      "content": {"application/json": {"schema": ref(ModelList)}}}}
    paths = {"/v1/completions": post(CompletionRequest, CompletionResponse, CompletionResponse, "Complete prompts"),
             "/v1/chat/completions": post(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
                                          "Answer a conversation"),
             "/v1/responses": post(ResponsesRequest, ResponseObject, None, "Answer an input (OpenAI's Responses API; "
                                   "stream true: its typed events)"),
             "/v1/embeddings": post(EmbeddingRequest, EmbeddingResponse, None,
                                    "Embed inputs (a server with --runner pooling)"),
             "/v1/classify": post((ClassifyRequest, ClassifyChatRequest), ClassificationResponse, None,
                                  "Classify inputs or a conversation (a *ForSequenceClassification model; also "
                                  "/classify)"),
             "/v1/score": post(ScoreRequest, ScoreResponse, None, "Score text pairs: the cosine similarity of their "
                                                                  "embeddings, or a cross-encoder's score (--runner "
                                                                  "pooling)"),
             "/v1/rerank": post(RerankRequest, RerankResponse, None, "Rank documents by their score against a query "
                                                                     "(--runner pooling)"),
             "/v1/models": {"get": {"summary": "List the served models", "responses": models}}}
    return {"openapi": "3.1.0", "info": {"title": "jaxpaged", "version": getattr(jaxpaged, "__version__", "0.1.0")},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}
