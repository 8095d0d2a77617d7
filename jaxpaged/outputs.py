"""What `LLM.generate` and `AsyncLLM.generate` hand back, shaped like vLLM's output types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class Logprob:
    """Log probability of one candidate token at one position.

    `rank` is 1 for the most likely token of the vocabulary; `decoded_token` is the
    token's own text (see `engine.detokenizer.decode_token`), None when not detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token and the top-`logprobs` candidates.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None because nothing predicts the first token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the `n` sequences generated for a request.

    `finish_reason` is None while generating, then "stop" (EOS, a stop token or a stop
    string) or "length" (max_tokens or max_model_len). `stop_reason` says which stop
    matched: the stop string, the stop token id, or None for EOS and "length".
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its `n` completions so far.

    `finished` turns True once every completion has a finish_reason. `num_cached_tokens`
    counts prompt tokens served from the prefix cache instead of being computed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Any = None
    lora_request: Any = None   # the LoRARequest it ran with (None: the base model)
    num_prompt_embeds: int = 0   # a prompt of embeddings (prompt_embeds): its rows; its prompt_token_ids are None

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length: its tokens, or its rows of embeddings."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else self.num_prompt_embeds


@dataclass
class PoolingOutput:
    """A pooled request's result (runner="pooling"): `data`, its embedding as f32[dims]."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """What `LLM.encode` and `AsyncLLM.encode` hand back for one prompt (vLLM's type)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Any = None   # AsyncLLM: the request's times (RequestTimes)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class _TaskRequestOutput:
    """A pooled prompt's output as one task names it (vLLM's `*RequestOutput.from_base`): `outputs` is the
    task's type (OUTPUT_TYPE) holding the pooled data as a list of floats."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool

    OUTPUT_TYPE: ClassVar[type]

    @classmethod
    def from_base(cls, output: PoolingRequestOutput):
        return cls(output.request_id, cls.OUTPUT_TYPE([float(x) for x in output.outputs.data]),
                   output.prompt_token_ids, output.finished)


@dataclass
class EmbeddingRequestOutput(_TaskRequestOutput):
    """What `LLM.embed` hands back for one prompt (vLLM's type): `outputs.embedding`, a list of floats."""

    outputs: EmbeddingOutput
    OUTPUT_TYPE: ClassVar[type] = EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]   # one per class: the classifier's activation of its logits (use_activation=False: logits)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(_TaskRequestOutput):
    """What `LLM.classify` hands back for one prompt (vLLM's type): `outputs.probs`, a list of floats."""

    outputs: ClassificationOutput
    OUTPUT_TYPE: ClassVar[type] = ClassificationOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` hands back for one pair (vLLM's type): `outputs.score`, the cosine similarity of
    the two texts' embeddings (an embedding model), or a cross-encoder's score of the pair read as one
    sequence (a classifier with one label)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]   # the first text's, then the second's
    finished: bool = True
