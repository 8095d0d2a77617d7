"""Per-request sampling settings, named and defaulted as in vLLM.

Every check raises `ValueError` naming the field, the value and the allowed range, so the
server can hand the message straight back to the client as a 400 error.
"""

from __future__ import annotations

import copy
import enum
import functools
import math
from dataclasses import dataclass, fields

# vLLM's default cap on top logprobs per token; larger values make every step return
# (and transfer) a wider top-k, so we refuse them instead of silently slowing down.
MAX_LOGPROBS = 20

# Temperatures below this are greedy: the distribution is a point mass (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names and values)."""

    CUMULATIVE = 0   # everything so far, every step the request progressed
    DELTA = 1        # only what is new since the request's previous output
    FINAL_ONLY = 2   # one output, when the request finished


def _require_int(name: str, value: object, allowed: str) -> None:
    # bool is an int subclass, but `n=True` is a client bug, not a count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def _require_float(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{' ' + allowed if allowed else ''}, got {value!r}")
    return float(value)


def _check_float_range(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if math.isinf(hi):
        allowed = f"{'>' if lo_open else '>='} {lo}"
    else:
        allowed = f"in {'(' if lo_open else '['}{lo}, {hi}]"
    v = _require_float(name, value, allowed)
    if v < lo or (lo_open and v == lo) or v > hi:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_optional_logprobs(name: str, value: int | None) -> None:
    if value is None:
        return
    allowed = f"None or in [0, {MAX_LOGPROBS}]"
    _require_int(name, value, allowed)
    if value == -1:
        raise ValueError(f"{name}=-1 (the whole vocabulary) is not supported; allowed: {allowed}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _as_list(name: str, value: object, allowed: str) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation); -1: the last
    max_model_len - 1, as many as leave room for one generated token (vLLM's -1 keeps max_model_len,
    which no prompt may fill). Values SamplingParams refuses (0, below -1) truncate nothing."""
    if truncate_prompt_tokens is None or truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
        return token_ids
    keep = max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return token_ids[max(len(token_ids) - keep, 0):]


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of

    json         a JSON schema (dict or JSON string): the output is a JSON value it accepts
    regex        the output full-matches this regular expression
    choice       the output is exactly one of these strings
    grammar      a Lark/EBNF grammar (llguidance's Lark dialect; GBNF `::=` rules are converted)
    json_object  True: any JSON object

    The grammar is compiled when the request is added: a bad schema, regex or grammar is a
    ValueError naming the field, and nothing is queued.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string), got {value!r}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                                 or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be True or None, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to sample one request; `__post_init__` validates and normalizes in place."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalized to 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len, resolved by the engine
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None   # sample only among these tokens
    bad_words: list[str] | None = None   # never generate these words (with and without a leading space)
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens; -1: as many as fit
    extra_args: dict | None = None   # arguments for custom logits processors (vLLM's; vllm_xargs over HTTP)

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "a string or a list of non-empty strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of token ids")
        if self.top_k == -1:
            self.top_k = 0
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids,
                                              "None or a non-empty list of token ids")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = _as_list("bad_words", self.bad_words, "None or a list of non-empty strings")
        if self.logit_bias is not None:
            self.logit_bias = self._normalized_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):   # as the server's JSON body gives it
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.KINDS)
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {sorted(unknown)}; allowed: "
                                 f"{', '.join(StructuredOutputsParams.KINDS)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    @staticmethod
    def _normalized_logit_bias(logit_bias: object) -> dict[int, float]:
        if not isinstance(logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}")
        normalized: dict[int, float] = {}
        for key, bias in logit_bias.items():
            # JSON object keys are always strings, so OpenAI clients send {"50256": -100}.
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}") from None
            if isinstance(key, (bool, float)) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            _check_float_range(f"logit_bias[{token_id}]", bias, -100.0, 100.0)
            normalized[token_id] = float(bias)
        return normalized

    def _verify(self) -> None:
        _require_int("n", self.n, ">= 1")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        _check_float_range("temperature", self.temperature, 0.0, math.inf)
        _check_float_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _require_int("top_k", self.top_k, "-1 or 0 (disabled) or >= 1")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        _check_float_range("min_p", self.min_p, 0.0, 1.0)
        _check_float_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True)
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens, "None or >= 1")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be None or >= 1, got {self.max_tokens!r}")
        _require_int("min_tokens", self.min_tokens, ">= 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        _check_optional_logprobs("logprobs", self.logprobs)
        _check_optional_logprobs("prompt_logprobs", self.prompt_logprobs)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {self.stop!r} need detokenize=True, got detokenize=False")
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id, ">= 0 in every entry")
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be >= 0 in every entry, got {self.stop_token_ids!r}")
        if self.seed is not None:
            _require_int("seed", self.seed, "or None")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list of token ids, got []")
            for token_id in self.allowed_token_ids:
                _require_int("allowed_token_ids", token_id, ">= 0 in every entry")
                if token_id < 0:   # the entry, not the list: it may hold a whole vocabulary
                    raise ValueError(f"allowed_token_ids must be >= 0 in every entry, got {token_id!r} in it")
        for word in self.bad_words or ():
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must contain non-empty strings, got {word!r} in it")
        if self.truncate_prompt_tokens is not None:
            _require_int("truncate_prompt_tokens", self.truncate_prompt_tokens, ">= 1 or -1 (as many as fit)")
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1 (as many as fit), "
                                 f"got {self.truncate_prompt_tokens!r}")
        if self.extra_args is not None and not (isinstance(self.extra_args, dict)
                                                and all(isinstance(k, str) for k in self.extra_args)):
            raise ValueError(f"extra_args must be None or a dict with string keys, got {self.extra_args!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got "
                             f"{self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            allowed = ", ".join(f"RequestOutputKind.{kind.name}" for kind in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {allowed}, got {self.output_kind!r}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> SamplingParams:
        """A deep copy: the engine may fill in defaults without touching the caller's object."""
        return copy.deepcopy(self)

    def was_set(self, name: str) -> bool:
        """Whether the caller passed `name` (a model's generation_config fills in only the others)."""
        return name in self._set_fields


def _recording_set_fields(init):
    """Wrap the dataclass __init__ so each instance knows which fields its caller passed."""
    names = [f.name for f in fields(SamplingParams) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._set_fields = frozenset(names[:len(args)]) | frozenset(kwargs)

    return __init__


SamplingParams.__init__ = _recording_set_fields(SamplingParams.__init__)


@dataclass
class BeamSearchParams:
    """Settings for `LLM.beam_search`, as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _require_int("beam_width", self.beam_width, ">= 1")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width!r}")
        _require_int("max_tokens", self.max_tokens, ">= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        _check_float_range("temperature", self.temperature, 0.0, math.inf)
        _require_float("length_penalty", self.length_penalty, "")
