"""Weight-only quantization: int8, fp8 and 4-bit weights, and GGUF's Q8_0, Q4_0 and Q4_1 kept as they are.

A quantized linear weight is a `QuantizedWeight` in our [in, out] layout: its values, one scale per
(group of `group_size` input rows, output column) and, for GGUF's Q4_1, one offset per group:

    w[k, n] = (value[k, n] - zero) * scale[k // group_size, n] + offset[k // group_size, n]

| mode   | values                                       | scales                    | from               |
| ------ | -------------------------------------------- | ------------------------- | ------------------ |
| int8   | int8 [K, N]                                  | per output channel        | `quantization="int8"` |
| fp8    | float8_e4m3fn [K, N]                         | per output channel        | `quantization="fp8"`  |
| int4   | uint8 [K // 2, N], two 4-bit values per byte | groups of 32, + offsets   | `quantization="int4"` |
| Q8_0   | int8 [K, N]                                  | groups of 32              | a GGUF file        |
| Q4_0   | 4-bit as int4, zero 8                        | groups of 32              | a GGUF file        |
| Q4_1   | 4-bit, zero 0, plus offsets (the minimums)   | groups of 32              | a GGUF file        |

4-bit values pack input rows 2i (low nibble) and 2i + 1 (high nibble) into byte row i. Activations
stay in the model dtype; `linear` de-quantizes (the jnp path; XLA on CPU materialises the weight
in the step). A quantized embedding (GGUF's token_embd) is kept as its LM head, [hidden, vocab]:
the logits are `linear(hidden, embed)` and a lookup de-quantizes the gathered columns.

Only the matmul weights of the layers are quantized by `quantization=`; the embedding, the LM head
and the norms stay in the model dtype, as vLLM does. This module chose a small hand-written format
over qwix's `QArray` (docs/results.md, "Why a hand-written format rather than qwix", has the
measurements): qwix requires an integer zero point of the values' dtype, so Q4_1's float minimums
cannot be held exactly, and its int4 values take one byte each in the live arrays.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

MODES = ("int8", "fp8", "int4")
"""The values of `quantization=` that quantize float weights at load."""
CHECKPOINT_MODES = ("gguf",)
"""Quantization only a checkpoint brings with it (kept, not re-quantized); "fp8" may be either."""

ALLOWED = (None, "auto") + MODES + CHECKPOINT_MODES


def resolve_quantization(requested: str | None, checkpoint: str | None) -> str | None:
    """What the loader does, from `quantization=` and the checkpoint's own quantization (`checkpoint`:
    "gguf" when a GGUF file holds Q8_0/Q4_0/Q4_1 matrices, "fp8" for an FP8 Hugging Face checkpoint,
    another method's name, or None): "auto" keeps the checkpoint's, None de-quantizes it, a mode
    quantizes float weights. Raises ValueError for a bad combination."""
    if requested not in ALLOWED:
        raise ValueError(f"quantization must be one of {', '.join(repr(m) for m in ALLOWED)}, got {requested!r}")
    if requested == "auto":
        return checkpoint
    if requested is None or requested == checkpoint:
        return requested
    if requested in CHECKPOINT_MODES:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized that way, and this one is "
                         f"{'quantized as ' + repr(checkpoint) if checkpoint else 'not quantized'}; use one of "
                         f"None, 'auto', {', '.join(repr(m) for m in MODES)}")
    if checkpoint is not None:
        raise ValueError(f"quantization={requested!r} cannot re-quantize a checkpoint already quantized as "
                         f"{checkpoint!r}; use 'auto' or {checkpoint!r} (keep it) or None (de-quantize it)")
    return requested


FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)   # 448
INT4_GROUP = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [in, out] weight (a scanned stack prepends [num_layers] to every array)."""
    values: jax.Array            # int8 | float8_e4m3fn [K, N], or uint8 [K // 2, N] when bits == 4
    scale: jax.Array             # f32[K // group_size, N]
    offset: jax.Array | None     # f32[K // group_size, N] added after the scale (Q4_1), or None
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    zero: int = dataclasses.field(default=0, metadata=dict(static=True))   # subtracted from each value

    @property
    def in_features(self) -> int:
        return self.values.shape[-2] * (2 if self.bits == 4 else 1)

    @property
    def out_features(self) -> int:
        return self.values.shape[-1]

    def unpacked(self, dtype) -> jax.Array:
        """The values minus `zero`, [..., K, N] in `dtype` (exact: they are small integers or fp8)."""
        v = self.values
        if self.bits == 4:
            v = jnp.stack([v & 15, v >> 4], axis=-2).reshape(*v.shape[:-2], 2 * v.shape[-2], v.shape[-1])
        v = v.astype(dtype)
        return v - self.zero if self.zero else v

    def dequantize(self, dtype) -> jax.Array:
        """The full-precision [K, N] weight in `dtype` (the kernel's own jnp reference)."""
        from jaxpaged.kernels.quantized_matmul import dequantize   # here: importing Pallas warns of its Triton backend
        return dequantize(self.values, self.scale, self.offset, bits=self.bits, group_size=self.group_size,
                          zero=self.zero, dtype=dtype)

    def specs(self, spec: P) -> "QuantizedWeight":
        """The partition specs of each array for a weight sharded as `spec` (a scale with one group
        row is replicated along the input axis)."""
        def for_groups(arr):
            if arr is None:
                return None
            parts = list(spec) + [None] * (arr.ndim - len(spec))
            if arr.shape[-2] == 1:
                parts[-2] = None
            return P(*parts)
        return dataclasses.replace(self, values=spec, scale=for_groups(self.scale), offset=for_groups(self.offset))

    def map_arrays(self, fn, spec: P) -> "QuantizedWeight":
        """fn(array, its partition spec) for each array of this weight sharded as `spec` (see `specs`)."""
        specs = self.specs(spec)
        return dataclasses.replace(self, values=fn(self.values, specs.values), scale=fn(self.scale, specs.scale),
                                   offset=None if self.offset is None else fn(self.offset, specs.offset))


KERNEL_MAX_ROWS = 64
"""Rows up to which `linear` hands a quantized matmul to the kernel (decode steps); a longer step is
compute-bound and de-quantizes the weight once for XLA's matmul."""


def matmul_kernel(name: str):
    """The quantized matmul `linear` uses for few rows: None ("reference": de-quantize, then XLA's matmul)
    or "pallas", the W8A16 / W4A16 kernel: on Mosaic GPU (jaxpaged.kernels.mosaic_matmul) on a Hopper GPU
    for the weights it tiles (columns in 64s, values in 64-row steps, 16-bit activations), the Pallas
    kernel through Triton (jaxpaged.kernels.quantized_matmul) for the others and on older GPUs; off a GPU
    the same choice in interpret mode. "auto": pallas on a GPU, reference elsewhere."""
    if name not in ("auto", "reference", "pallas"):
        raise ValueError(f"quantized_matmul must be one of 'auto', 'reference', 'pallas', got {name!r}")
    platform = jax.devices()[0].platform
    if name == "reference" or (name == "auto" and platform != "gpu"):
        return None
    from jaxpaged.kernels.backends import has_wgmma
    from jaxpaged.kernels.mosaic_matmul import mosaic_matmul_plan, quantized_matmul_mosaic
    from jaxpaged.kernels.quantized_matmul import quantized_matmul_pallas
    interpret = platform != "gpu"
    mosaic = interpret or has_wgmma()

    def kernel(x, w: QuantizedWeight):
        group = w.in_features // w.scale.shape[-2]   # from the shapes: a row-parallel shard's channels span its rows
        args = (x, w.values, w.scale, w.offset)
        statics = dict(bits=w.bits, group_size=group, zero=w.zero, interpret=interpret)
        if mosaic and mosaic_matmul_plan(*args, **statics) is not None:
            return quantized_matmul_mosaic(*args, **statics)
        return quantized_matmul_pallas(*args, **statics)
    return kernel


def linear(x: jax.Array, w, kernel=None) -> jax.Array:
    """x @ w for a plain or quantized [in, out] weight; the result in x's dtype. `kernel` (from
    `matmul_kernel`, per shard under a mesh: ShardPlan.matmul) takes quantized matmuls of up to
    KERNEL_MAX_ROWS rows."""
    if not isinstance(w, QuantizedWeight):
        return x @ w
    if kernel is not None and x.shape[0] <= KERNEL_MAX_ROWS:
        return kernel(x, w)
    if w.group_size == w.in_features and w.offset is None:   # per channel: scale the output
        y = jnp.matmul(x, w.unpacked(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scale).astype(x.dtype)
    return x @ w.dequantize(x.dtype)


def embedding_lookup(embed, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the embedding: [vocab, hidden] plain, or a quantized [hidden, vocab] LM head."""
    if not isinstance(embed, QuantizedWeight):
        return embed[ids]
    cols = dataclasses.replace(embed, values=embed.values[:, ids], scale=embed.scale[:, ids],
                               offset=None if embed.offset is None else embed.offset[:, ids])
    return cols.dequantize(dtype).T


def weight_nbytes(tree) -> int:
    """Bytes of every array in a weight tree (quantized weights count values, scales and offsets)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------
# Host side: quantizing float weights and reading GGUF blocks, in numpy, one tensor at a time.

@dataclasses.dataclass
class HostQuantized:
    """A quantized weight on the host in the checkpoint's [out, in] (or, after `.T`, our [in, out])
    orientation, values unpacked: the loader transposes, fuses and repeats heads on every field
    along the output axis alike (`map_fields`), then `to_device` packs it."""
    values: np.ndarray           # int8 | uint8 (4-bit, 0..15) | float8_e4m3fn, [out, in] or [in, out]
    scale: np.ndarray            # f32, [out, groups] or [groups, out]
    offset: np.ndarray | None
    bits: int
    group_size: int
    zero: int = 0
    kind: str = ""               # "int8", "Q4_1", ...: for messages and reports

    @property
    def T(self) -> "HostQuantized":
        return self.map_fields(lambda a: a.T)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def astype(self, dtype) -> "HostQuantized":
        return self   # the values keep their quantized dtype

    def map_fields(self, fn) -> "HostQuantized":
        return dataclasses.replace(self, values=fn(self.values), scale=fn(self.scale),
                                   offset=None if self.offset is None else fn(self.offset))

    def as_float(self) -> np.ndarray:
        """f32 in the checkpoint's [out, in] orientation (a tensor as the reader returns it)."""
        return self.T.dequantize().T

    def dequantize(self) -> np.ndarray:
        """f32 in this orientation; requires the [in, out] one (after `.T`)."""
        k, n = self.values.shape
        v = self.values.astype(np.float32) - self.zero
        w = v.reshape(k // self.group_size, self.group_size, n) * self.scale[:, None, :]
        if self.offset is not None:
            w = w + self.offset[:, None, :]
        return w.reshape(k, n)

    def packed(self) -> QuantizedWeight:
        """The numpy arrays of the device format ([in, out] orientation)."""
        values = self.values
        if self.bits == 4:
            values = (values[0::2] | (values[1::2] << 4)).astype(np.uint8)
        return QuantizedWeight(np.ascontiguousarray(values), np.ascontiguousarray(self.scale, np.float32),
                               None if self.offset is None else np.ascontiguousarray(self.offset, np.float32),
                               bits=self.bits, group_size=self.group_size, zero=self.zero)


def combine(parts: list, fn):
    """`fn` (a list of arrays -> one array, e.g. a concatenation along the output axis) applied to
    plain parts, or to each field of HostQuantized parts alike."""
    first = parts[0]
    if not isinstance(first, HostQuantized):
        return fn(parts)
    if any((p.bits, p.group_size, p.zero, p.offset is None) != (first.bits, first.group_size, first.zero,
                                                                 first.offset is None) for p in parts):
        raise ValueError(f"cannot fuse weights of different quantization types: {[p.kind for p in parts]}")
    return dataclasses.replace(first, values=fn([p.values for p in parts]), scale=fn([p.scale for p in parts]),
                               offset=None if first.offset is None else fn([p.offset for p in parts]))


def int4_group_size(in_features: int, tp: int = 1) -> int:
    """int4's group: 32 input rows (GGUF's Q4_0 block), whatever the tensor parallelism, so every layout
    computes with the same weights; each device's share of the rows must hold whole groups."""
    if in_features % (INT4_GROUP * tp):
        raise ValueError(f"quantization='int4' needs input sizes divisible by 32 x tensor_parallel_size "
                         f"({INT4_GROUP * tp}); a weight has {in_features} input rows")
    return INT4_GROUP


def quantize(w: np.ndarray, mode: str, tp: int = 1) -> HostQuantized:
    """Quantize a float [in, out] weight: int8 / fp8 per output channel (symmetric), int4 in groups of 32
    (asymmetric: a scale and a minimum per group)."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if mode in ("int8", "fp8"):
        qmax = 127.0 if mode == "int8" else FP8_MAX
        scale = np.max(np.abs(w), axis=0, keepdims=True) / qmax
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        if mode == "int8":
            values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        else:
            values = np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        return HostQuantized(values, scale, None, bits=8, group_size=k, kind=mode)
    if mode == "int4":   # asymmetric, as AWQ and GGUF's Q4_1: 16 steps from each group's minimum to its maximum
        g = int4_group_size(k, tp)
        groups = w.reshape(k // g, g, n)
        low, high = groups.min(axis=1), groups.max(axis=1)
        scale = ((high - low) / 15.0).astype(np.float32)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        values = np.clip(np.rint((groups - low[:, None, :]) / scale[:, None, :]), 0, 15)
        return HostQuantized(values.reshape(k, n).astype(np.uint8), scale, low.astype(np.float32), bits=4,
                             group_size=g, kind="int4")
    raise ValueError(f"quantization must be one of None, {', '.join(repr(m) for m in MODES)}, got {mode!r}")


GGUF_NATIVE = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32)}   # type -> (bytes per block, values)


def from_gguf_blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> HostQuantized:
    """A GGUF Q8_0 / Q4_0 / Q4_1 tensor's raw blocks (uint8 [rows, bytes per row]) as [out, in] fields.

    Block layouts (ggml): Q8_0 = f16 scale, 32 int8; Q4_0 = f16 scale, 16 bytes of nibbles
    (w = (q - 8) * d); Q4_1 = f16 scale, f16 minimum, 16 bytes (w = q * d + m). In a 4-bit block,
    byte j holds value j in its low nibble and value j + 16 in its high one.
    """
    block_bytes, block_values = GGUF_NATIVE[kind]
    blocks = np.asarray(data, np.uint8).reshape(rows, cols // block_values, block_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        values = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return HostQuantized(values, scale, None, bits=8, group_size=32, kind=kind)
    start = 2 if kind == "Q4_0" else 4
    nibbles = blocks[..., start:start + 16]
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols)
    if kind == "Q4_0":
        return HostQuantized(values, scale, None, bits=4, group_size=32, zero=8, kind=kind)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return HostQuantized(values, scale, minimum, bits=4, group_size=32, kind=kind)
