"""Logprobs in the OpenAI shapes the server answers with (vLLM's): a completion's, a chat choice's, and
vLLM's prompt_logprobs; `decode` names a token (its text, or `token_id_name` for return_tokens_as_token_ids)."""

import math

from jaxpaged.outputs import Logprob

# JSON has no -inf; vLLM reports masked-out candidates with this floor instead.
_LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def token_id_name(token_id: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids names it in logprobs (a token that is part of a
    character has no text of its own)."""
    return f"token_id:{token_id}"


def _token_text(token_id: int, entry: dict[int, Logprob] | None, decode) -> str:
    if decode is token_id_name:
        return token_id_name(token_id)
    lp = entry.get(token_id) if entry else None
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode(token_id)


def _best(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def prompt_logprobs(entries: list, decode) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (None: the first) its candidates by token id."""
    return [None if entry is None else
            {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": _token_text(t, entry, decode)}
             for t, lp in entry.items()} for entry in entries]


def completion_logprobs(token_ids: list[int], entries: list, text_offset: int, decode) -> dict:
    """/v1/completions format; an entry of None (the first prompt token) has no logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(token_id, entry, decode)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(entry[token_id].logprob) if entry else None)
        top = None
        if entry:
            top = {}
            for candidate, lp in _best(entry):   # two ids can read the same ("\ufffd"): keep the likelier
                top.setdefault(_token_text(candidate, entry, decode), _finite(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], entries: list, top_n: int, decode) -> dict:
    """/v1/chat/completions format: one object per token with its `top_n` best candidates."""
    def item(token_id, lp: Logprob, entry) -> dict:
        text = _token_text(token_id, entry, decode)
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, entry[t], entry),
                         "top_logprobs": [item(c, lp, entry) for c, lp in _best(entry)[:top_n]]}
                        for t, entry in zip(token_ids, entries)]}
