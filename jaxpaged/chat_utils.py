"""Chat messages through a chat template, the same way for `LLM.chat` and the server."""

import inspect
import json


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template: str | None = None,
                add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
                continue_final_message: bool = False) -> str:
    """The prompt text of a conversation; `tools` (OpenAI function tools) go to the template as vLLM
    passes them, `chat_template_kwargs` as more template variables (Qwen3's enable_thinking);
    `continue_final_message`: the last message left open for the model to continue (transformers cuts the
    text after its content), instead of a new turn's generation prompt. Raises ValueError for a variable
    that is one of apply_chat_template's own arguments, for both continue_final_message and
    add_generation_prompt, and what the template raises (no template, its own checks of roles and order)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first continues "
                         "the last message, the second opens a new turn (set add_generation_prompt to false)")
    extra = dict(chat_template_kwargs or {})
    taken = extra and sorted(set(extra) & (set(inspect.signature(tokenizer.apply_chat_template).parameters)
                                           - {"kwargs"}))
    if taken:
        raise ValueError(f"chat_template_kwargs must not set {', '.join(taken)}: it is an argument of the "
                         "chat template call itself (use the request's own field)")
    return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                         chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **extra)


def render_chat_images(tokenizer, messages: list[dict], images, *args, **kwargs) -> tuple[str, list]:
    """`render_chat` of messages that may hold image parts (engine/media.chat_images), and their images.
    `images`: the engine's multimodal.ImageInputs, or the reason it takes none (a str: ValueError naming the
    first image part). A template that places no image token (it reads content as a string) gets each image's
    placeholder before the message's text, as vLLM's "string" content format."""
    from jaxpaged.engine.media import chat_images, text_content
    refused, local_root = (images, None) if isinstance(images, str) else (None, images.local_root)
    messages, found = chat_images(messages, refused, local_root, None if refused else images.embedded_part)
    text = render_chat(tokenizer, messages, *args, **kwargs)
    if found and text.count(images.placeholder) < len(found):
        text = render_chat(tokenizer, text_content(messages, images.placeholder), *args, **kwargs)
    return text, found


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: a tool call's arguments as an object (OpenAI sends
    a JSON string; Hermes-style templates apply `tojson` to it)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_template_call(c) for c in calls]}
        out.append(message)
    return out


def _template_call(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass   # a template gets what the client sent
    return {**call, "function": {**function, "arguments": arguments}}
