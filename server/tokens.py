"""vLLM's /tokenize and /detokenize: a prompt (or messages through the chat template) to token ids, and back."""

from jaxpaged.server import protocol as P
from jaxpaged.server.vllm_types import DetokenizeRequest, TokenizeRequest


async def tokenize(server, request) -> dict:
    req = P.validate(TokenizeRequest, await server.read_json(request))
    server.model(req.model)
    if req.messages is not None:
        _, ids, _ = server.render_chat(P.message_dicts(req.messages), req.add_generation_prompt,
                                       P.tool_dicts(req.tools), req.chat_template_kwargs, req.continue_final_message,
                                       req.mm_processor_kwargs)
    elif req.prompt is not None:
        special = req.add_special_tokens is not False
        ids = list(server.need_tokenizer("prompt").encode(req.prompt, add_special_tokens=special))
    else:
        raise P.APIError(400, "tokenize needs prompt (a string) or messages", "prompt", "missing_required_parameter")
    return {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids}


async def detokenize(server, request) -> dict:
    req = P.validate(DetokenizeRequest, await server.read_json(request))
    server.model(req.model)
    tokens, vocab = req.tokens, server.engine.model_config.vocab_size
    if not all(0 <= t < vocab for t in tokens):
        raise P.APIError(400, f"tokens must be a list of token ids in [0, {vocab}), got {P.brief_repr(tokens)}",
                         "tokens", "invalid_value")
    return {"prompt": server.need_tokenizer("tokens").decode(tokens)}
