"""OpenAI's Responses API (/v1/responses) as pydantic models: the request body and the response object
(the stream's events carry these items). The route itself is server/responses_api.py."""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from jaxpaged.server.openai_types import _Strict, _unsupported
from jaxpaged.server.response_types import _Out

# OpenAI's request fields, as the `openai` package lists them (a test keeps these in step with it): each is
# a field below, implemented or declared `_unsupported`
OPENAI_RESPONSES_FIELDS = (
    "access_programs", "background", "background_options", "context_management", "conversation", "image",
    "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream_options",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user")


# ---- the request ---------------------------------------------------------------------------
class InputText(_Strict):
    type: Literal["input_text", "output_text"]   # (an earlier answer's text comes back as output_text)
    text: str


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(_Strict):
    """An earlier answer's call (as this server sent it, or the client's own record)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningInputItem(_Strict):
    """An earlier answer's reasoning: it goes to the template with the answer that follows it."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[ReasoningText] | None = None


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem,
                      Field(union_mode="left_to_right")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema | None = Field(None, discriminator="type")
    verbosity: Literal["medium"] | None = _unsupported('"medium"')


class ReasoningConfig(_Strict):
    """How much to think: `effort` goes to the template as `reasoning_effort` (gpt-oss' "Reasoning: low");
    no summary is written (a reasoning item's `summary` stays empty), whatever `summary` asks."""
    effort: Literal["none", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses. Besides OpenAI's fields, vLLM's sampling fields pass through to the engine as on
    /v1/chat/completions (top_k, seed, stop, logit_bias, structured_outputs, chat_template_kwargs, ...)."""
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="a string, or a non-empty list of messages and function_call / function_call_output items")
    instructions: str | None = None   # a system message before the input (not carried to the next turn)
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    store: bool | None = None   # true (the default): kept in memory for previous_response_id and GET
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None   # hints for a prefix cache that is automatic here: accepted, ignored
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    service_tier: Literal["auto", "default"] | None = _unsupported('"auto" or "default"')
    truncation: Literal["disabled"] | None = _unsupported('"disabled"')
    background: Literal[False] | None = _unsupported("false")
    include: Annotated[list[Any], Field(max_length=0)] | None = _unsupported("[]")
    reasoning: ReasoningConfig | None = None
    max_tool_calls: None = _unsupported()
    top_logprobs: Literal[0] | None = _unsupported("0")
    prompt: None = _unsupported()
    conversation: None = _unsupported()
    background_options: None = _unsupported()
    context_management: None = _unsupported()
    access_programs: None = _unsupported()
    image: None = _unsupported()
    moderation: None = _unsupported()


# ---- the response ----------------------------------------------------------------------------
class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] | None = None


class MessageItem(_Out):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOutput(_Out):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningContent(_Out):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Out):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningContent]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[MessageItem | FunctionCallOutput | ReasoningItem, Field(discriminator="type")]


class InputTokensDetails(_Out):
    cached_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Out):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: None = None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str] | None
    user: str | None
    reasoning: dict[str, Any] | None = None
