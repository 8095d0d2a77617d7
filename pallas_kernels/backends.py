"""Pick an attention implementation by name.

    reference      plain jnp (pallas_kernels/reference.py): ground truth, and the CPU path
    pallas         Pallas on Mosaic GPU (mosaic_attention.py): TMA and wgmma, Hopper (compute capability
                   9.x), bfloat16 / float16; on a CPU it runs in GPU interpret mode (slow: tests)
    triton         a Triton kernel through jax-triton; needs a CUDA GPU
    pallas_triton  the Pallas kernel through Pallas' Triton lowering (deprecated by JAX 0.11): any CUDA GPU
                   Triton supports; kept until the GPU check has measured `pallas` against it
    cpu            the reference, on a CPU (an alias, kept for configurations that name it)
    auto           on a CUDA GPU the fastest of the kernels that run there (`gpu_candidates`), measured at
                   start-up on the model's head shapes (`measure_fastest`); the reference elsewhere

An unavailable backend is an error, never a silent fallback.
"""

import functools
import logging
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "pallas", "triton", "pallas_triton", "cpu")
AMPERE = (8, 0)     # bfloat16 arithmetic


class AttentionFn(Protocol):
    """What every backend's attention is called with and returns (its own tuning options follow, keyword-only)."""

    def __call__(
        self,
        q: jax.Array,             # [num_tokens, num_heads, head_dim]
        kv_pool: jax.Array,       # [num_layers, 2, num_blocks, kv_heads, block_size, head_dim]
        layer: jax.Array,         # i32[] which layer of the pool to read
        md: AttentionMetadata,    # the ragged batch: query ranges, kv lengths, block tables
        sliding_window: jax.Array | int = 0,  # i32[]; 0 = no window, else keys with q_pos - k_pos < window
        soft_cap: float | jax.Array = 0.0,    # 0 = off, else logits -> cap * tanh(logits / cap)
        *,
        sm_scale: float,          # the logits' scale (1 / sqrt(head_dim) unless the model says otherwise)
        sinks: jax.Array | None = None,   # [num_heads] attention sinks (gpt-oss): a logit per head in each sum
    ) -> jax.Array:               # [num_tokens, num_heads, head_dim], the dtype of q
        ...


def compute_capability(device=None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (the default device if None); None for any other device."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    return tuple(int(part) for part in str(capability).split(".")[:2])


def has_wgmma(device=None) -> bool:
    """Whether the device runs the Mosaic GPU kernels: Hopper (compute capability 9.x: TMA and wgmma).
    Blackwell's tensor cores take tcgen05 instead of wgmma."""
    capability = compute_capability(device)
    return capability is not None and capability[0] == 9


def _has_jax_triton() -> bool:
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_candidates(device=None, dtype=jnp.bfloat16, head_dim: int | None = None) -> list[str]:
    """The backends `auto` measures on this GPU for a model of this dtype and head_dim, best guess first.

    The Mosaic GPU kernel needs Hopper, a 16-bit dtype and head_dim <= 256; the Triton kernels lower on
    older GPUs (A100, L4); below Ampere (T4), or for heads wider than 256 (latent attention's 576: no
    kernel here was built or measured for them), the reference joins them, so that something always runs."""
    capability = compute_capability(device) or (0, 0)
    candidates = []
    if has_wgmma(device) and jnp.dtype(dtype) != jnp.float32 and (head_dim or 0) <= 256:
        candidates.append("pallas")
    if _has_jax_triton():
        candidates.append("triton")
    candidates.append("pallas_triton")
    if capability < AMPERE or (head_dim or 0) > 256:
        candidates.append("reference")
    return candidates


def resolve_backend(name: str, platform: str | None = None, head_shape: tuple[int, int, int] | None = None,
                    dtype=jnp.bfloat16, device=None) -> str:
    """A concrete backend name; `head_shape` = (num_heads, kv_heads, head_dim) lets auto measure."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    device = device or jax.devices()[0]
    platform = platform or device.platform
    if name == "auto":
        if platform != "gpu":
            return "reference"
        candidates = gpu_candidates(device, dtype, head_shape and head_shape[2])
        if head_shape is None or len(candidates) == 1:
            return candidates[0]
        return measure_fastest({c: get_attention(c, platform) for c in candidates}, *head_shape, dtype)
    if name in ("triton", "pallas_triton") and platform != "gpu":
        raise ValueError(f"attention_backend={name!r} needs a CUDA GPU (Triton kernels cannot run on {platform}); "
                         "use 'reference' or 'pallas'")
    if name == "triton" and not _has_jax_triton():
        raise ValueError("attention_backend='triton' needs jax-triton: pip install 'jaxpaged[cuda12]'")
    if name == "pallas" and platform == "gpu" and not has_wgmma(device):
        raise ValueError(f"attention_backend='pallas' (Mosaic GPU: TMA, wgmma) needs a Hopper GPU (compute "
                         f"capability 9.x); this {device.device_kind} has "
                         f"{'.'.join(map(str, compute_capability(device) or ()))}: use 'auto', 'triton' or "
                         "'pallas_triton'")
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on a CPU, not {platform}; use 'auto'")
        return "reference"
    return name


def get_attention(name: str, platform: str | None = None) -> AttentionFn:
    """The attention function of a resolved backend name."""
    platform = platform or jax.devices()[0].platform
    if name == "reference":
        from jaxpaged.kernels.reference import ragged_paged_attention_reference
        return ragged_paged_attention_reference
    if name == "pallas":
        from jaxpaged.kernels.mosaic_attention import ragged_paged_attention_mosaic
        return functools.partial(ragged_paged_attention_mosaic, interpret=platform != "gpu")
    if name == "pallas_triton":
        from jaxpaged.kernels.pallas_attention import ragged_paged_attention_pallas
        return ragged_paged_attention_pallas
    if name == "triton":
        from jaxpaged.kernels.triton_attention import ragged_paged_attention_triton
        return ragged_paged_attention_triton
    raise ValueError(f"unknown attention backend {name!r}")


def measure_fastest(kernels: dict, num_heads: int, kv_heads: int, head_dim: int, dtype,
                    num_seqs: int = 64, context: int = 1024, block_size: int = 16, repeats: int = 30) -> str:
    """Time each kernel on a decode batch (num_seqs x context tokens); returns the fastest name.

    At this size a call takes ~0.15 ms on an H200, near the cost of dispatching it from Python: with 5
    calls an H200 start-up can pick Pallas, which the GPU check's medians put 20% slower at this size
    (0.162 against Triton's 0.134 ms); 30 calls average the dispatch out.

    A kernel that fails to compile or run is skipped (and logged); if all fail, the first is returned
    so that its error surfaces when the model runs.
    """
    from jaxpaged.kernels.layout import kv_pool_shape
    from jaxpaged.kernels.metadata import AttentionMetadata

    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    pool = jnp.zeros(kv_pool_shape(1, num_blocks, block_size, kv_heads, head_dim), dtype)
    q = jnp.ones((num_seqs, num_heads, head_dim), dtype)
    tables = np.arange(1, num_blocks, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
    md = AttentionMetadata(kv_lens=jnp.full((num_seqs,), context, jnp.int32), block_tables=jnp.asarray(tables),
                           cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32), q_tile=1)
    layer = jnp.zeros((), jnp.int32)
    timings = {}
    for name, kernel in kernels.items():
        try:
            fn = jax.jit(functools.partial(kernel, sm_scale=head_dim ** -0.5))
            fn(q, pool, layer, md).block_until_ready()
            start = time.perf_counter()
            for _ in range(repeats):
                out = fn(q, pool, layer, md)
            out.block_until_ready()
            timings[name] = (time.perf_counter() - start) / repeats
        except Exception as exc:  # a kernel that cannot run here is not a candidate
            logger.warning("attention backend %s unavailable: %s", name, exc)
    if not timings:
        return next(iter(kernels))
    best = min(timings, key=timings.get)
    logger.info("attention backend auto -> %s (%s)", best,
                ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in timings.items()))
    return best
