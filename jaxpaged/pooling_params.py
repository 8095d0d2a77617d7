"""Embeddings (vLLM's pooling runner): what a request asks (PoolingParams), how the model pools
(PoolerConfig), and the host's last touch on a pooled vector (dimensions, normalization).

An engine made with `runner="pooling"` runs each prompt once and hands back its embedding: the
final-normed hidden state of the prompt's last token (pooling_type "LAST", vLLM's default for a
causal LM used as an embedding model), the mean of every prompt token's ("MEAN") or the first token's
("CLS"; runner/pooled_rows.py), L2-normalized unless asked not to. A sentence-transformers
checkpoint's own pooling (modules.json, 1_Pooling/config.json) decides instead where it has one.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes (1_Pooling/config.json's pooling_mode_*) -> ours
_SENTENCE_TRANSFORMERS_MODES = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS"}


def resolve_runner(runner: str, hf_config, pooler_config=None, speculative_config=None) -> str:
    """The runner an engine runs: "auto" is "pooling" for a model without an LM head (a bare *Model, an
    embedding checkpoint, or a *ForSequenceClassification), else "generate"; a headless one cannot generate,
    a generating engine has no pooler_config and a pooling one no speculative_config."""
    from jaxpaged.models.config import BASE_MODEL_ARCHITECTURES, is_classifier

    architectures = getattr(hf_config, "architectures", None) or []
    bare = bool(architectures) and (architectures[0] in BASE_MODEL_ARCHITECTURES or is_classifier(hf_config))
    if runner == "auto":
        runner = "pooling" if bare else "generate"
    if runner == "generate" and pooler_config is not None:
        raise ValueError("pooler_config must be None with runner='generate' (the model generates): set "
                         "runner='pooling' to embed")
    if runner == "pooling" and speculative_config is not None:
        raise ValueError(f"speculative_config must be None with runner='pooling' ({architectures[0]} embeds: "
                         "nothing to draft)")
    if runner == "generate" and bare:
        raise ValueError(f"runner='generate' needs a model with an LM head; {architectures[0]} has none (an "
                         "embedding checkpoint or a classifier): use runner='pooling' or 'auto'")
    return runner


@dataclasses.dataclass
class PoolerConfig:
    """vLLM's PoolerConfig: how every request's embedding is pooled (`pooler_config=` / --pooler-config)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be True or False, got {self.normalize!r}")

    @classmethod
    def of(cls, value: PoolerConfig | dict | str | None, model_path: str | None) -> PoolerConfig:
        """The engine's pooler: `value` as given (a PoolerConfig, a dict or its JSON), else the
        checkpoint's sentence-transformers pooling, else LAST with normalization."""
        from jaxpaged.engine.arg_utils import json_config
        if isinstance(value, PoolerConfig):
            return value
        if value is None:
            return sentence_transformers_pooler(model_path) or cls()
        return cls(**json_config("pooler_config", value, [f.name for f in dataclasses.fields(cls)]))


def sentence_transformers_pooler(model_path: str | None) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json: a Pooling module's
    config, a Normalize module), or None when the folder has none. A pooling this engine has not
    built is an error, never replaced by another."""
    modules_file = os.path.join(model_path, "modules.json") if model_path and os.path.isdir(model_path) else None
    if modules_file is None or not os.path.exists(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    pooling_file = os.path.join(model_path, kinds.get("Pooling", "-"), "config.json")
    if "Pooling" not in kinds or not os.path.exists(pooling_file):   # (no declaration: the default)
        return None
    with open(pooling_file) as f:
        modes = [k[len("pooling_mode_"):] for k, on in json.load(f).items() if k.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _SENTENCE_TRANSFORMERS_MODES:
        raise ValueError(f"the checkpoint's sentence-transformers pooling is {modes}; supported: one of "
                         f"{', '.join(_SENTENCE_TRANSFORMERS_MODES)}: pass pooler_config={{'pooling_type': 'LAST'}} "
                         "(or MEAN, CLS) to use it anyway")
    return PoolerConfig(_SENTENCE_TRANSFORMERS_MODES[modes[0]], normalize="Normalize" in kinds)


@dataclasses.dataclass
class PoolingParams:
    """What one pooling request asks (vLLM's PoolingParams): `truncate_prompt_tokens` (the prompt's last k
    tokens; -1: as many as fit); for an embedding, `dimensions` (its first k, Matryoshka models only) and
    `normalize` (None: the pooler's); for a classifier's probabilities or score, `use_activation` (None or
    True: softmax / sigmoid as the model's config says; False: the raw logits). `task` ("embed",
    "classify", "score"; None: the model's own) is set by LLM.encode(pooling_task=...) or here."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be None or an int >= 1, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be None, True or False, got {getattr(self, name)!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < -1 or t == 0):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {t!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be None or one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    def verify(self, hidden_size: int, matryoshka: bool) -> None:
        """ValueError for options the request's task does not take (as vLLM), and `dimensions` the model
        cannot give (Matryoshka models only)."""
        wrong = [name for name, tasks in _TASK_OPTIONS.items() if getattr(self, name) is not None
                 and self.task not in tasks]
        if wrong:
            raise ValueError(f"{wrong[0]} applies to the {' and '.join(_TASK_OPTIONS[wrong[0]])} task, not "
                             f"{self.task}; allowed: None")
        if self.dimensions is None:
            return
        if not matryoshka:
            raise ValueError(f"dimensions={self.dimensions}: the model does not support Matryoshka "
                             "representation (its config sets no is_matryoshka or matryoshka_dimensions); "
                             "allowed: None")
        if self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is more than the model's {hidden_size}; "
                             f"allowed: None or [1, {hidden_size}]")


POOLING_TASKS = ("embed", "classify", "score")
_TASK_OPTIONS = {"dimensions": ("embed",), "normalize": ("embed",), "use_activation": ("classify", "score")}


def score_pairs(num_first: int, num_second: int, names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple]:
    """The (first, second) index pairs vLLM's score compares: the one first text against each second (1 to
    N), or pair by pair (N to N); ValueError naming `names[0]` otherwise."""
    if num_second < 1 or num_first not in (1, num_second):
        raise ValueError(f"{names[0]} ({num_first} prompts) must be one prompt or as many as {names[1]} "
                         f"({num_second}), and {names[1]} at least one")
    return [(0 if num_first == 1 else i, i) for i in range(num_second)]


def cross_encoder_ids(tokenizer, first, second) -> list[int]:
    """A pair as a cross-encoder reads it, one sequence: two texts through the tokenizer's pair encoding
    (tokenizer(first, text_pair=second), its special tokens and separators, as transformers and vLLM);
    two token-id prompts joined as given. Prompts may be dicts ({"prompt": ...} / {"prompt_token_ids": ...})."""
    def unwrap(prompt):
        if isinstance(prompt, dict):
            return prompt.get("prompt_token_ids", prompt.get("prompt"))
        return prompt
    a, b = unwrap(first), unwrap(second)
    if isinstance(a, str) and isinstance(b, str):
        if tokenizer is None:
            raise ValueError("data_1 is text but the model has no tokenizer: pass token ids")
        return list(tokenizer(a, text_pair=b)["input_ids"])
    if isinstance(a, list) and isinstance(b, list) and all(isinstance(t, int) for t in a + b):
        return a + b
    raise ValueError(f"data_1 and data_2 must be both texts or both token-id lists for a cross-encoder, got "
                     f"{type(a).__name__} and {type(b).__name__}")


def cosine_similarity(a, b) -> float:
    """The cosine of the angle between two embeddings (as torch's, with its eps of 1e-8)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8))


def finish_embedding(vector: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> np.ndarray:
    """A pooled vector as the request asks: its first `dimensions`, then L2-normalized (by default)."""
    vector = np.asarray(vector, np.float32)
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if pooler.normalize if params.normalize is None else params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):   # exp(-x) = inf for a very negative logit: 1 / inf = 0, as it should
        return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def _identity(x: np.ndarray) -> np.ndarray:
    return x


# a cross-encoder's activation as sentence-transformers names it (config.sentence_transformers["activation_fn"]);
# None: a sigmoid for one label, a softmax for several
_TORCH_ACTIVATIONS = {"torch.nn.modules.linear.Identity": _identity, "torch.nn.modules.activation.Sigmoid": None,
                      "torch.nn.modules.activation.Softmax": None, "torch.nn.modules.activation.Tanh": np.tanh}


def classifier_activations(hf_config) -> dict:
    """task -> the function a classifier's logits go through (vLLM's, after transformers' losses):
    "classify": none for problem_type "regression", a sigmoid per class for "multi_label_classification",
    else a sigmoid for one label and a softmax for several; "score" (a cross-encoder): the
    sentence-transformers activation the config names, else a sigmoid (one label) or a softmax."""
    by_labels = _sigmoid if getattr(hf_config, "num_labels", 1) < 2 else _softmax
    classify = {"regression": _identity, "multi_label_classification": _sigmoid}.get(
        getattr(hf_config, "problem_type", None), by_labels)
    settings = getattr(hf_config, "sentence_transformers", None)
    name = (settings.get("activation_fn") if isinstance(settings, dict) else None) or getattr(
        hf_config, "sbert_ce_default_activation_function", None)
    if name is not None and name not in _TORCH_ACTIVATIONS:
        raise ValueError(f"the checkpoint's cross-encoder activation_fn {name!r} is not supported; supported: "
                         f"{', '.join(_TORCH_ACTIVATIONS)}")
    return {"classify": classify, "score": (_TORCH_ACTIVATIONS[name] if name else None) or by_labels}
