"""The OpenAI protocol's request bodies as pydantic models: the one definition of the wire format
(the responses' are in response_types.py).

Requests are validated by them (protocol.py turns their errors into OpenAI error objects),
responses are passed through theirs, and /openapi.json is generated from both (server/openapi.py).
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# OpenAI's request fields, as the `openai` package lists them (a test keeps these in step with the installed
# one). Each is a field of its route's request model: implemented, or declared with `_unsupported` so that
# only the values asking for nothing pass and a client never believes e.g. audio output was honoured.
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
_UNSUPPORTED = "x-unsupported"   # schema key of an unimplemented field: the values it accepts, for the 400


def _unsupported(accepts: str = "") -> Any:
    """An OpenAI field this server does not implement; its type admits only values asking for nothing."""
    note = f" (it accepts only {accepts})" if accepts else ""
    return Field(None, description=f"not supported by this server{note}", json_schema_extra={_UNSUPPORTED: accepts})


# ---- requests ------------------------------------------------------------------------------
class _Strict(BaseModel):
    # nested objects: keys beyond OpenAI's are dropped (clients echo whole response messages back)
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str   # data:image/<format>;base64,... or http(s)://
    detail: Literal["auto", "low", "high"] | None = None   # (accepted; the image processor's size is the model's)


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class ImageEmbedsPart(_Strict):
    """vLLM's (--enable-mm-embeds): one image as the vision tower's output rows, base64 of torch.save(tensor) or
    of a .npy file; Qwen2-VL's as {"image_embeds": ..., "image_grid_thw": ...}."""
    type: Literal["image_embeds"]
    image_embeds: str | dict[str, str] = Field(description="base64 of torch.save(tensor) or a .npy file, or Qwen2-VL's "
                                                           '{"image_embeds": ..., "image_grid_thw": ...} of them')


class FunctionCall(_Strict):
    name: str
    arguments: str   # JSON, as the model wrote it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: str
    # images: a vision-language model's (the part's type picks its model, so an error names the right field)
    content: str | list[Annotated[TextPart | ImagePart | ImageEmbedsPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None      # an assistant's earlier calls
    tool_call_id: str | None = None               # a tool message: the call it answers
    reasoning: str | None = None                  # an assistant's earlier reasoning (to the template, as
    reasoning_content: str | None = None          # reasoning_content: Qwen3's template reads it)

    @model_validator(mode="after")
    def _tool_answers_a_call(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError('(role "tool") needs tool_call_id, the id of the call it answers')
        return self


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaSpec(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


_MessageList = Annotated[list[Message], Field(min_length=1, description='a non-empty list of messages '
                                              '{"role", "content", "name"?, "tool_calls"?, "tool_call_id"?}')]


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None   # vLLM's: with include_usage, every chunk carries its usage so far


class _Request(_Strict):
    """Fields both routes share; a key in neither OpenAI's list nor ours stays in model_extra."""
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    user: str | None = None   # bookkeeping for OpenAI, accepted and ignored
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    logit_bias: dict[str, float] | None = Field(None, description="an object mapping token ids to biases")
    top_k: int | None = None   # vLLM's fields from here
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: Annotated[list[int], Field(min_length=1)] | None = None   # sample only among these
    bad_words: list[str] | None = None   # words never generated
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None   # the prompt's last k tokens (-1: all that fit)
    return_tokens_as_token_ids: bool | None = None   # logprobs name each token "token_id:<id>", not by its text
    return_token_ids: bool | None = None   # choices carry their token ids, and the prompt's
    prompt_logprobs: int | None = None   # each prompt token's logprob and its best candidates (not streamed)
    priority: int | None = None   # --scheduling-policy priority: the lower, the sooner (else only 0)
    # requests share prefix-cache blocks only under the same salt (tenants never see each other's)
    cache_salt: Annotated[str, Field(min_length=1)] | None = Field(None, description="a non-empty string")
    structured_outputs: dict[str, Any] | None = Field(
        None, description='{"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | '
                          '{"json_object": true}')
    # vLLM's: arguments for the server's custom logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = Field(
        None, description="an object of strings, numbers or lists of them, for custom logits processors")
    # OpenAI's on chat; vLLM takes it on completions too: both become structured_outputs
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = Field(
        None, discriminator="type", description='{"type": "text"}, {"type": "json_object"} or '
                                                '{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}')

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("stream"):
            raise ValueError("is not available when stream is true (as in vLLM)")
        return value


class CompletionRequest(_Request):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)] | None = Field(
            None, description="a string, a non-empty list of strings, a list of token ids or a list of token-id lists")
    echo: bool | None = None
    # vLLM's (--enable-prompt-embeds): base64 of torch.save(tensor [tokens, hidden]) (or of a .npy file), or a list
    prompt_embeds: str | Annotated[list[str], Field(min_length=1)] | None = None
    logprobs: int | None = None
    best_of: int | None = _unsupported("1 or the value of n")
    suffix: Literal[""] | None = _unsupported('""')

    @field_validator("best_of")
    @classmethod
    def _one_sample_each(cls, value, info: ValidationInfo):
        if value is not None and value not in (1, info.data.get("n") or 1):
            raise ValueError("asks for more samples than n")
        return value


class ChatCompletionRequest(_Request):
    messages: _MessageList
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None   # vLLM's
    continue_final_message: bool | None = None   # vLLM's: continue the last message (then no generation prompt)
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM's: more variables for the template (enable_thinking)
    mm_processor_kwargs: dict[str, Any] | None = None   # vLLM's: the image processor's arguments (max_pixels)
    echo: bool | None = None   # vLLM's: the answer begins with the last message's content if of the answer's role
    include_reasoning: bool | None = None   # vLLM's: false drops the reasoning (--reasoning-parser) from the answer
    # to the template as `reasoning_effort` (gpt-oss' "Reasoning: low"), over chat_template_kwargs' (as vLLM)
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = None
    # OpenAI's that change no generated token, accepted and ignored: bookkeeping (metadata only matters
    # with store, which is refused) and hints for a prefix cache that is automatic here
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    functions: Annotated[list[Any], Field(max_length=0)] | None = _unsupported("[]")
    function_call: Literal["none", "auto"] | None = _unsupported('"none" or "auto" without functions')
    audio: None = _unsupported()
    modalities: list[Literal["text"]] | None = _unsupported('["text"]')
    prediction: None = _unsupported()
    verbosity: Literal["medium"] | None = _unsupported('"medium" (the default)')
    service_tier: Literal["auto", "default"] | None = _unsupported('"auto" or "default"')
    store: Literal[False] | None = _unsupported("false")
    moderation: None = _unsupported()
    web_search_options: None = _unsupported()

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs to be true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _among_the_tools(cls, value, info: ValidationInfo):
        if "tools" not in info.data:   # tools failed validation: that error is the one reported
            return value
        names = [t.function.name for t in info.data["tools"] or []]
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            offered = ", ".join(names) if names else "none (tools is empty)"
            raise ValueError(f"names the function {value.function.name!r}, which is not among the tools "
                             f"(offered: {offered})")
        if value == "required" and not names:
            raise ValueError('"required" needs tools to call')
        return value


EmbeddingInput = Annotated[
    str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)],
    Field(description="a string, a non-empty list of strings, a list of token ids or a list of token-id lists")]


class EmbeddingRequest(_Strict):
    """/v1/embeddings (a server with --runner pooling); keys beyond these are ignored, as vLLM has more."""
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None   # Matryoshka models only
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None   # vLLM's
    add_special_tokens: bool | None = None   # vLLM's: the tokenizer's BOS for a text input (default true)
    priority: int | None = None   # vLLM's: --scheduling-policy priority
