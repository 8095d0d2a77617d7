"""Custom logits processors (vLLM's `logits_processors`, the batch-level interface of its Model Runner V2),
written in JAX and compiled into the engine's sampler.

A processor is a class: the engine makes an instance per model replica at start-up (on a GPU one more, briefly,
for the probe that sizes the KV cache) and calls

    validate_params(params)      (classmethod) when a request is added: a ValueError refuses it (a 400 over HTTP)
    add_request(slot, params)    on the host, when a request takes a slot of the persistent batch (it starts, comes
                                 back after preemption, or is an n > 1 sibling): set that slot's state, and return
                                 whether to change this request's logits
    state()                      on the host, after add_request calls: the pytree of arrays `apply` reads (fixed
                                 shapes and dtypes: it is an argument of programs compiled at start-up), copied
                                 whole to the device
    apply(logits, ctx, state)    traced, inside the sampler of every step: f32[S, V] logits -> f32[S, V]; ctx
                                 (LogitsContext) gives each row's slot and output so far

`apply` sees each sample row's logits after logit_bias, allowed_token_ids, bad words, penalties, min_tokens and a
structured output's mask, and before temperature, min_p, top-k and top-p (vLLM's order); only the rows of requests
it claimed keep its changes (the engine selects them), so it may compute every row. Per-request arguments ride in
`SamplingParams.extra_args` (`vllm_xargs` over HTTP). Processors run in the order given, after installed plugins
(the `jaxpaged.logits_processors` entry-point group). A claimed request never takes the plain-greedy fast path.

Slots are reused: a slot's state must be fully set again by `add_request` (a slot no request holds is never
sampled). Not with speculative decoding, pooling runners or several hosts (refused at start-up, as vLLM).
"""

import abc
import dataclasses
import functools
import importlib
from importlib.metadata import entry_points

import jax
import jax.numpy as jnp
import numpy as np

ENTRY_POINT_GROUP = "jaxpaged.logits_processors"


@dataclasses.dataclass(frozen=True)
class LogitsProcessorConfig:
    """What a processor is built for (its __init__ argument)."""

    vocab_size: int        # V: the logits' width (the model's embedding rows; may exceed the tokenizer's)
    num_slots: int         # rows of per-slot state: max_num_seqs slots and the padding row (the last)
    max_model_len: int
    tokenizer: object = None   # the engine's tokenizer (None with skip_tokenizer_init)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsContext:
    """The step's sample rows, as `apply` sees them (traced arrays)."""

    slots: jax.Array              # i32[S]: the slot whose request each row samples for (padding rows: the last slot)
    num_output_tokens: jax.Array  # i32[S]: tokens the row's request sampled before this one
    active: jax.Array             # bool[S]: this processor claimed the row's request (add_request returned True)
    # i32[num_slots, max_model_len]: each slot's request's output tokens so far (row s valid up to the
    # num_output_tokens of the rows reading slot s; a row's own: output_tokens[slots])
    output_tokens: jax.Array


class LogitsProcessor(abc.ABC):
    """Subclass and define `apply` (and override what else the module docstring lists)."""

    def __init__(self, config: LogitsProcessorConfig):
        self.config = config

    @classmethod
    def validate_params(cls, params) -> None:
        """Raise ValueError for a request's bad arguments (params.extra_args), naming them."""

    def add_request(self, slot: int, params) -> bool:
        """Host, changes state: a request takes `slot`; returns whether this processor changes its logits."""
        return True

    def state(self):
        """The pytree of arrays (numpy or jax) `apply` reads; None: none."""
        return None

    @abc.abstractmethod
    def apply(self, logits: jax.Array, ctx: LogitsContext, state) -> jax.Array:
        """Traced: f32[S, V] -> f32[S, V] (rows of requests not claimed are ignored)."""


def _resolve(spec, index: int) -> type:
    if isinstance(spec, str):
        module, sep, qualname = spec.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"logits_processors[{index}] must be a LogitsProcessor subclass or 'module:Class', "
                             f"got {spec!r}")
        try:
            obj = importlib.import_module(module)
            for attr in qualname.split("."):
                obj = getattr(obj, attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"logits_processors[{index}]: cannot load {spec!r}: {exc}") from None
        spec = obj
    if not (isinstance(spec, type) and issubclass(spec, LogitsProcessor)):
        raise ValueError(f"logits_processors[{index}] must be a subclass of jaxpaged.LogitsProcessor "
                         f"(or 'module:Class' naming one), got {spec!r}")
    if spec.__abstractmethods__:
        raise ValueError(f"logits_processors[{index}]: {spec.__name__} must define "
                         f"{', '.join(sorted(spec.__abstractmethods__))}")
    return spec


@functools.cache
def _plugins() -> tuple[type, ...]:
    classes = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        cls = entry.load()
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"the {ENTRY_POINT_GROUP} entry point {entry.name!r} is not a LogitsProcessor "
                             f"subclass: {cls!r}")
        classes.append(cls)
    return tuple(classes)


def load_logits_processors(specs) -> tuple[type, ...]:
    """The processor classes an engine runs: installed plugins, then `specs` (classes or 'module:Class'
    strings; None: none). Raises ValueError naming logits_processors."""
    if specs is None:
        specs = []
    elif isinstance(specs, (str, type)) or not isinstance(specs, (list, tuple)):
        raise ValueError(f"logits_processors must be a list of LogitsProcessor subclasses or 'module:Class' "
                         f"strings, got {specs!r}")
    return _plugins() + tuple(_resolve(spec, i) for i, spec in enumerate(specs))


def _shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


class LogitsProcessors:
    """An engine's processors and what the sampler reads of them: the claims (bool[P, num_slots]) and
    each processor's state, on the device (uploaded again after a request took a slot)."""

    def __init__(self, classes: tuple[type, ...], config: LogitsProcessorConfig):
        self.config = config
        self.classes = classes
        self.processors = tuple(cls(config) for cls in classes)
        self.claims = np.zeros((len(classes), config.num_slots), bool)
        self._on_device = None
        self._spec = None

    def validate_params(self, params) -> None:
        for cls in self.classes:
            cls.validate_params(params)

    def add_request(self, slot: int, params) -> bool:
        """Host, changes state: each processor's add_request; returns whether any claimed the request."""
        for i, processor in enumerate(self.processors):
            self.claims[i, slot] = bool(processor.add_request(slot, params))
        self._on_device = None
        return bool(self.claims[:, slot].any())

    def host_state(self):
        return self.claims.copy(), tuple(processor.state() for processor in self.processors)

    def spec(self):
        """The state's shapes and dtypes, as the sampler is compiled for them (those at start-up)."""
        if self._spec is None:
            self._spec = _shapes(self.host_state())
        return self._spec

    def device_state(self, plan):
        """The state on `plan`'s devices (copied there if a request took a slot since the last call)."""
        if self._on_device is None:
            state = self.host_state()
            now = _shapes(state)
            if jax.tree.structure(now) != jax.tree.structure(self.spec()) or jax.tree.leaves(now) != jax.tree.leaves(
                    self.spec()):
                raise RuntimeError(f"a logits processor's state() changed its arrays' shapes or dtypes since start-up "
                                   f"(the sampler is compiled for them): {self.spec()} -> {now}")
            self._on_device = plan.put(state)
        return self._on_device

    def apply(self, logits: jax.Array, state, slots: jax.Array, num_output_tokens: jax.Array,
              output_tokens: jax.Array) -> jax.Array:
        """Traced: each processor's apply in turn, kept on the rows of the requests it claimed."""
        claims, states = state
        for i, processor in enumerate(self.processors):
            active = claims[i][slots]
            out = processor.apply(logits, LogitsContext(slots, num_output_tokens, active, output_tokens), states[i])
            if getattr(out, "shape", None) != logits.shape:
                raise ValueError(f"{type(processor).__name__}.apply must return the logits' shape {logits.shape}, "
                                 f"got {getattr(out, 'shape', type(out).__name__)}")
            logits = jnp.where(active[:, None], out.astype(jnp.float32), logits)
        return logits
