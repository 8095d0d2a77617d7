"""A request's input, made ready for the scheduler (vLLM V1's InputProcessor): the prompt tokenized
and truncated, every field checked against this model (a ValueError naming the field queues
nothing), bad words turned into token ids. A prompt of embeddings (`{"prompt_embeds": ...}`, with
enable_prompt_embeds) becomes placeholder token ids and its rows (engine/prompt_embeds.py); a prompt's images
(`multi_modal_data`, a vision-language model) become their tokens and rows (engine/multimodal.py)."""

import dataclasses

import numpy as np

from jaxpaged.engine.media import image_list
from jaxpaged.engine.prompt_embeds import as_embeds, block_digests
from jaxpaged.sampling_params import SamplingParams, truncate_prompt


@dataclasses.dataclass
class ProcessedPrompt:
    text: str | None               # the prompt as the user gave it (None: token ids only)
    token_ids: list[int]           # the tokens the request starts from (truncated where asked)
    cache_salt: str | None
    bad_words_token_ids: list[list[int]]
    embeds: np.ndarray | None = None       # a prompt of embeddings: its rows (token_ids are placeholders)
    embeds_digests: tuple[bytes | None, ...] = ()  # ... and each block's SHA-256 (the prefix cache's hash keys)
    image_rows: tuple = ()                 # images: ((first position, rows), ...) (Request.embed_ranges)
    mrope: tuple | None = None             # Qwen2-VL's images: (Request.mrope_offsets, mrope_delta)


@dataclasses.dataclass(frozen=True)
class EmbedsSpec:
    """What prompt embeddings this engine takes (enable_prompt_embeds): their width and dtype, and
    the block size their digests cover."""
    hidden_size: int
    dtype: object
    block_size: int


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int, check_prompt_len,
                 scheduling_policy: str = "fcfs", embeds: EmbedsSpec | None = None, images=None,
                 no_images: str = "this model takes text only"):
        self.tokenizer = tokenizer
        self.embeds = embeds   # None: prompt_embeds refused (enable_prompt_embeds off)
        self.images = images   # multimodal.ImageInputs; None: multi_modal_data refused (`no_images` says why)
        self.no_images = no_images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.check_prompt_len = check_prompt_len   # the scheduler's: ValueError for a prompt that cannot run
        self.scheduling_policy = scheduling_policy

    def check_priority(self, priority) -> int:
        """A request's priority: any int under scheduling_policy="priority", else 0 only (as vLLM)."""
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an int, got {type(priority).__name__}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine's is "
                             f"{self.scheduling_policy!r}); allowed here: 0")
        return int(priority)

    def process(self, prompt, params: SamplingParams) -> ProcessedPrompt:
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            return self.process_embeds(prompt, params)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            return self.process_images(prompt, params)
        text, token_ids = self.tokenize(prompt)
        cache_salt = self.cache_salt(prompt)
        token_ids = self.truncate(token_ids, params.truncate_prompt_tokens)
        self.validate(token_ids, params)
        return ProcessedPrompt(text, token_ids, cache_salt, self.banned_words(params))

    def process_embeds(self, prompt: dict, params: SamplingParams) -> ProcessedPrompt:
        """An EmbedsPrompt: its rows checked against the model and truncated as asked."""
        embeds = self.prompt_embeds(prompt)
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the prompt's token ids; a prompt of embeddings has none "
                             "(allowed with prompt_embeds: None)")
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(list(range(len(embeds))), params.truncate_prompt_tokens, self.max_model_len)
            embeds = embeds[kept[0]:]
        token_ids = [0] * len(embeds)
        self.validate(token_ids, params)
        return ProcessedPrompt(None, token_ids, self.cache_salt(prompt), self.banned_words(params), embeds,
                               block_digests(embeds, self.embeds.block_size))

    def process_images(self, prompt: dict, params: SamplingParams) -> ProcessedPrompt:
        """A prompt with `multi_modal_data` (images): its tokens with each image's placeholder expanded, and
        the images' rows from the vision tower."""
        if self.images is None:
            raise ValueError(f"multi_modal_data needs a vision-language model whose images jaxpaged runs "
                             f"(LLaVA, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL): {self.no_images}")
        images = image_list(prompt["multi_modal_data"])
        text, token_ids = self.tokenize({**prompt, "multi_modal_data": None})
        token_ids, rows, digests, mrope = self.images.process(
            token_ids, images, lambda ids: self.truncate(ids, params.truncate_prompt_tokens),
            prompt.get("mm_processor_kwargs"))
        self.validate(token_ids, params)
        return ProcessedPrompt(text, token_ids, self.cache_salt(prompt), self.banned_words(params),
                               embeds_digests=digests, image_rows=rows, mrope=mrope)

    def prompt_embeds(self, prompt: dict) -> np.ndarray:
        """A prompt dict's `prompt_embeds` as an array [tokens, hidden_size] of the model's dtype."""
        if self.embeds is None:
            raise ValueError("prompt_embeds needs an engine built with enable_prompt_embeds=True "
                             "(--enable-prompt-embeds)")
        if "prompt_token_ids" in prompt or "prompt" in prompt or prompt.get("multi_modal_data") is not None:
            raise ValueError("a prompt dict holds 'prompt_embeds' or 'prompt'/'prompt_token_ids' (with "
                             "multi_modal_data), not both")
        return as_embeds(prompt["prompt_embeds"], self.embeds.hidden_size, self.embeds.dtype)

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:   # process() takes them; the rest, tokens
            raise ValueError("prompt_embeds are taken by generation only (LLM.generate, /v1/completions); "
                             "this call needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data (images) is taken by generation only (LLM.generate, LLM.chat, "
                             "chat completions); this call needs 'prompt' or 'prompt_token_ids' alone")
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass prompt_token_ids instead")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def cache_salt(prompt) -> str | None:
        """A prompt dict's `cache_salt`: requests share prefix-cache blocks only under the same salt."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def truncate(self, token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        return truncate_prompt(token_ids, truncate_prompt_tokens, self.max_model_len)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (got 0 tokens)")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        self.check_prompt_len(len(token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}={value} is more than this engine's max_logprobs "
                                 f"({self.max_logprobs}); allowed: None or [0, {self.max_logprobs}]")
        for name, ids in (("stop_token_ids", params.stop_token_ids or []),
                          ("logit_bias", list((params.logit_bias or {}).keys())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is out of range [0, {vocab})")

    def banned_words(self, params: SamplingParams) -> list[list[int]]:
        """The request's bad words as token ids; ValueError when they ban every allowed token."""
        bad_words = self.bad_words_token_ids(params.bad_words)
        if params.allowed_token_ids and set(params.allowed_token_ids) <= {w[0] for w in bad_words if len(w) == 1}:
            raise ValueError("allowed_token_ids leaves no token to sample: bad_words bans every one of them")
        return bad_words

    def bad_words_token_ids(self, bad_words: list[str] | None) -> list[list[int]]:
        """Each bad word as token ids, as vLLM tokenizes them: the word with its leading spaces
        stripped, and with one leading space where that gives as many tokens but another first one
        (the word in the middle of a text)."""
        if not bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer; this engine has none")
        words = []
        for word in bad_words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain:   # a text the tokenizer drops (nothing to ban)
                continue
            words.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                words.append(spaced)
        bad = [t for word in words for t in word if not 0 <= t < self.vocab_size]
        if bad:   # a tokenizer larger than the model's embedding
            raise ValueError(f"bad_words token id {bad[0]} is out of range [0, {self.vocab_size})")
        return words
