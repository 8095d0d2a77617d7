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
