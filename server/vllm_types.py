"""Request models of vLLM's routes beyond OpenAI's (/tokenize, /detokenize, LoRA adapters): keys beyond
these are ignored, as vLLM has more of its own."""

from typing import Annotated, Any

from pydantic import Field

from jaxpaged.server.openai_types import EmbeddingInput, Tool, _MessageList, _Strict


class TokenizeRequest(_Strict):
    """/tokenize: a prompt, or messages (and tools) rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None
    messages: _MessageList | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(description="a list of token ids")


_AdapterField = Annotated[str, Field(min_length=1, description="a non-empty string")]


class LoadLoRAAdapterRequest(_Strict):
    lora_name: _AdapterField
    lora_path: _AdapterField


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: _AdapterField


_Texts = str | Annotated[list[str], Field(min_length=1)]


class ScoreRequest(_Strict):
    """/score (and /v1/score): with an embedding model, the cosine similarity of text_1 and each text_2; with
    a cross-encoder (a classifier of one label), its score of each pair."""
    model: str | None = None
    text_1: _Texts = Field(description="a string or a non-empty list of strings")
    text_2: _Texts = Field(description="a string or a non-empty list of strings")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int | None = None


class RerankRequest(_Strict):
    """/rerank (and /v1/rerank, /v2/rerank; Jina's and Cohere's shape): the documents by their score against the
    query (as /score)."""
    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1)] = Field(description="a non-empty list of strings")
    top_n: Annotated[int, Field(ge=0)] | None = None   # 0 or none: all
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int | None = None


class ClassifyRequest(_Strict):
    """/classify (a *ForSequenceClassification model): each input's class probabilities (`input` as
    /v1/embeddings'); ClassifyChatRequest classifies a conversation instead."""
    model: str | None = None
    input: EmbeddingInput
    add_special_tokens: bool | None = None   # with a text input: the tokenizer's BOS (default true)
    use_activation: bool | None = None   # false: the raw logits (a reward model's reward), not probabilities
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    user: str | None = None
    priority: int | None = None


class ClassifyChatRequest(_Strict):
    """/classify of one conversation, rendered by the chat template (a reward model's input)."""
    model: str | None = None
    messages: _MessageList
    add_generation_prompt: bool | None = None   # default false, as vLLM's pooling routes
    use_activation: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    user: str | None = None
    priority: int | None = None
