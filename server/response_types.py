"""The OpenAI protocol's response bodies (and stream chunks) as pydantic models: every response the
server builds passes through one of them (protocol.response), and /openapi.json documents them."""

from typing import Literal

from pydantic import BaseModel, ConfigDict

from jaxpaged.server.openai_types import ToolCall   # an assistant message's tool calls, as requests carry them


class _Out(BaseModel):
    # a key the server sends must be declared here: the schema then documents every one
    model_config = ConfigDict(extra="forbid")


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class PromptTokensDetails(_Out):
    cached_tokens: int   # prompt tokens served from the prefix cache


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]   # None: the first prompt token (echo) has none
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Out):
    logprob: float
    rank: int | None = None           # 1: the likeliest token of the vocabulary
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]   # per prompt token (None: the first), by token id


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None   # vLLM's: the stop token id or stop string that ended it
    token_ids: list[int] | None = None          # vLLM's return_token_ids: the tokens of `text` (generated)
    prompt_token_ids: list[int] | None = None   # and the prompt's (a stream: in the choice's first chunk)
    prompt_logprobs: PromptLogprobs | None = None   # vLLM's prompt_logprobs


class CompletionResponse(_Out):
    """A /v1/completions response, and (without usage until the last) each of its stream's chunks."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None = None


class ChatMessage(_Out):
    role: Literal["assistant"]
    content: str | None = None   # None: only tool calls (or only reasoning)
    reasoning: str | None = None   # vLLM's, with --reasoning-parser: the thinking before the answer
    reasoning_content: str | None = None   # the same, under vLLM's earlier name
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None   # vLLM's return_token_ids: the generated tokens


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None   # vLLM's return_token_ids: the rendered conversation's tokens
    prompt_logprobs: PromptLogprobs | None = None   # vLLM's prompt_logprobs


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None   # a piece of the JSON; the pieces of one call concatenate to it


class DeltaToolCall(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class Delta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(_Out):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None   # vLLM's return_token_ids: this chunk's new tokens


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None   # only in the last chunk, with stream_options.include_usage
    prompt_token_ids: list[int] | None = None   # vLLM's return_token_ids: in the first chunk only


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorInfo


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None        # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingData(_Out):
    index: int
    object: Literal["embedding"]
    embedding: list[float] | str   # str: base64 of the little-endian float32 values (encoding_format)


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ClassificationData(_Out):
    index: int
    label: str   # the most probable class's name (the config's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage


class ScoreData(_Out):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(_Out):
    text: str


class RerankResult(_Out):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(_Out):
    total_tokens: int


class RerankResponse(_Out):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
