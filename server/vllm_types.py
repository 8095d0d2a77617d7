"""Request models of vLLM's routes beyond OpenAI's (/tokenize, /detokenize, LoRA adapters): keys beyond
these are ignored, as vLLM has more of its own."""

from typing import Annotated

from pydantic import Field

from jaxpaged.server.openai_types import Tool, _MessageList, _Strict


class TokenizeRequest(_Strict):
    """/tokenize: a prompt, or messages (and tools) rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None
    messages: _MessageList | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = None


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
    """/score (and /v1/score): with an embedding model, the cosine similarity of text_1 and each text_2."""
    model: str | None = None
    text_1: _Texts = Field(description="a string or a non-empty list of strings")
    text_2: _Texts = Field(description="a string or a non-empty list of strings")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int | None = None


class RerankRequest(_Strict):
    """/rerank (and /v1/rerank, /v2/rerank; Jina's and Cohere's shape): the documents by similarity to the query."""
    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1)] = Field(description="a non-empty list of strings")
    top_n: Annotated[int, Field(ge=0)] | None = None   # 0 or none: all
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int | None = None
