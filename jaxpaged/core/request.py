"""A request's host-side state: its tokens, how many are in the KV pool, where they live."""

import enum
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED

    @property
    def finish_reason(self) -> str | None:
        return {"finished_stopped": "stop", "finished_length": "length",
                "finished_aborted": "abort"}.get(self.value)


# a tuple: `status in FINISHED` compares identities (an Enum member hashes in Python)
FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """One sequence being generated.

    The single scheduling rule: `num_computed_tokens` (tokens whose K/V are in the pool, or
    being written by a dispatched step) catches up with `num_tokens_with_placeholders`
    (prompt + generated, counting tokens sampled on the device but not fetched yet). A
    prefill, a prompt chunk and a decode are all "compute the next tokens".
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None,
                 seed: int = 0, max_tokens: int | None = None, cache_salt: str | None = None,
                 lora_request: Any = None, priority: int = 0, prompt_embeds: Any = None,
                 prompt_embeds_digests: tuple[bytes | None, ...] = (), image_rows: tuple = (),
                 mrope: tuple | None = None):
        self.request_id = request_id
        self.priority = priority              # scheduling_policy="priority": the lower, the sooner
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # the token ids whose sampling may stop it (EOS unless ignore_eos, stop_token_ids): a step's
        # token outside this set, the lengths and a grammar is a decision made without a call
        self.stop_token_set = frozenset(() if getattr(sampling_params, "ignore_eos", False) else eos_token_ids) \
            | frozenset(getattr(sampling_params, "stop_token_ids", None) or ())
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.seed = seed                      # per-request sampling seed (drawn when the user gave none)
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1           # prefix-cache hit at first schedule (-1: not scheduled yet)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.cache_salt = cache_salt          # prefix-cache namespace: only equal salts share blocks
        self.lora_request = lora_request      # multi-LoRA: its adapter (a LoRARequest), None: the base model
        self.lora_slot = -1                   # the adapter's slot in the step (set when scheduled; -1: base)
        self.matcher = None                   # structured outputs: its grammar matcher (opaque here)
        # bad_words as token ids (set by the engine, which has the tokenizer): a word of one token is
        # banned from the start (banned_token_ids); a longer one's last token only where the output so far
        # ends with its other tokens (bad_word_sequences, checked by the host before each sampler)
        self.banned_token_ids: tuple[int, ...] = ()
        self.bad_word_sequences: tuple[tuple[int, ...], ...] = ()
        # its sampler waits for a token mask the host builds from its latest token: a grammar, or a bad
        # word of several tokens (an attribute, not a property: a step reads it for every decode)
        self.needs_host_mask = False
        self.custom_logits = False   # a custom logits processor claimed it (set when it takes a slot)
        self.block_hashes: list[bytes] = []   # chained hashes of the full blocks of all_token_ids
        # a prompt of embeddings (enable_prompt_embeds): its rows (opaque here: the runner reads them, below)
        # stand for its prompt tokens, which are placeholders; each block's digest of them enters its hash
        self.prompt_embeds_digests = prompt_embeds_digests   # (images': None for a block of text alone)
        self.num_embeds_tokens = len(prompt_token_ids) if prompt_embeds is not None else 0
        # the prompt's runs of rows the step reads in place of tokens, (first position, rows): the prompt of
        # embeddings whole, or each image's rows where its tokens are (engine/multimodal.py)
        self.embed_ranges = ((0, prompt_embeds),) if prompt_embeds is not None else tuple(image_rows)
        self.embeds_end = max((first + len(rows) for first, rows in self.embed_ranges), default=0)
        # Qwen2-VL's images (M-RoPE): each of the first prompt tokens' (time, height, width) rope positions less
        # (its position + mrope_delta), i32[n, 3]; every later token turns its position + mrope_delta on all three
        self.mrope_offsets, self.mrope_delta = mrope if mrope is not None else (None, 0)
        # runner="pooling" with MEAN or CLS pooling: what its chunks' hidden states gave so far (opaque here)
        self.pool_state = None
        # tokens it had when its K/V began from the first token: a length-dependent rope (LongRoPE)
        # encodes every position for this length (ForwardBatch.rope_lens); 0: not scheduled yet
        self.rope_len = 0
        # n > 1: sibling sequences that fork off this one when it samples its first token
        self.pending_forks: list["Request"] = []
        # tokens sampled by steps dispatched but not fetched yet (async scheduling): their
        # positions are computed by the next step, whose input token comes from the device
        self.num_placeholders = 0
        # speculative decoding: tokens proposed to follow the last one, verified by the next step
        # (the scheduler may use fewer; cleared once the step is planned)
        self.spec_token_ids: list[int] = []

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens the scheduler plans with: the known ones plus those still on the device."""
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens sampled so far, fetched or not (what the sampler's step counter sees)."""
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    def constrain(self, matcher, bad_words_token_ids: list[list[int]]) -> None:
        """Set its grammar matcher (None: none) and its bad words as token ids."""
        self.matcher = matcher
        self.banned_token_ids = tuple(sorted({word[0] for word in bad_words_token_ids if len(word) == 1}))
        self.bad_word_sequences = tuple(tuple(word) for word in bad_words_token_ids if len(word) > 1)
        self.needs_host_mask = matcher is not None or bool(self.bad_word_sequences)

    def bad_word_bans(self) -> list[int]:
        """The tokens its next one must not be: the last token of each bad word of several tokens whose
        other tokens end the output so far (vLLM's bad_words read the output, not the prompt)."""
        out = self.output_token_ids
        return [word[-1] for word in self.bad_word_sequences
                if len(word) - 1 <= len(out) and tuple(out[len(out) - len(word) + 1:]) == word[:-1]]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def token_stop(request: Request, max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """Stop decided by the last token alone: (status, stop_reason) or None to go on."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in (params.stop_token_ids or ()):
            return RequestStatus.FINISHED_STOPPED, token
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def advance_grammar(request: Request, stop):
    """Feed a constrained request's new token to its matcher; a grammar that admits nothing more
    (a choice made, a closed JSON value) ends the request as a stop, also on its last allowed
    token (the output is whole: not "length")."""
    token = request.output_token_ids[-1]
    eos = token in request.eos_token_ids
    if not eos and not request.matcher.consume_token(token):
        logger.error("request %s: token %d is outside its grammar (%s)", request.request_id, token,
                     request.matcher.get_error())
    if (stop is None or stop[0] == RequestStatus.FINISHED_LENGTH) and request.matcher.is_stopped():
        return RequestStatus.FINISHED_STOPPED, None
    return stop
