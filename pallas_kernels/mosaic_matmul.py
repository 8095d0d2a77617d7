"""Weight-only quantized matmul (W8A16, W4A16) as a Pallas kernel on Mosaic GPU (Hopper: TMA, wgmma).

Same contract and weight layouts as `quantized_matmul.py` (its `quantized_matmul_reference` is the
ground truth). Decode steps have a few activation rows and a weight of thousands of columns, so the
product is computed transposed, with the weight's columns on wgmma's 64-row side:

    y^T [N, M] = W^T [N, K] @ x^T [K, M]           M padded to a multiple of 8 (wgmma's narrow side)

    grid  = N / 64 columns x `splits` programs, one CUDA block of one warpgroup each; a split takes a
            contiguous share of the K steps (split-K: a 4096-wide weight alone gives 64 programs, under
            half an H100's 132 SMs), its fp32 partial summed by the wrapper
    step  = 64 or 128 rows of `values` of the program's 64 columns (a group, part of one, or several):
              values tile (int8 / fp8 [rows, 64], or 4-bit bytes [rows / 2, 64]) and x's [M, rows]
              -> SMEM by TMA, `slots` steps in flight
              de-quantized in registers as the reference does, (v - zero) * scale + offset, to x's
              dtype -> SMEM -> acc += W_tile^T @ x_tile^T (wgmma, fp32; the 16-bit A operand is read
              transposed from SMEM)
    out   = acc [64, M] -> SMEM -> TMA to y^T; the wrapper transposes the [N, M] result

A 4-bit byte row holds input rows 2i (low nibble) and 2i + 1 (high): the low and high nibble tiles
meet x's even and odd columns (split once by the wrapper) in two wgmmas a step.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels.quantized_matmul import validate_quantized_matmul

COLUMNS = 64          # weight columns per program: wgmma's M
_MAX_STEP_ROWS = 128  # input rows per step when a scale group is longer (or the scale per channel)
_MAX_SLOTS = 8        # steps in flight at most: a decode matmul waits on memory
_SMEM_BYTES = 160 * 1024
_SMS = 132            # streaming multiprocessors when the device does not say (H100 / H200)


def _swizzled(dtype, minor: int):
    """SMEM transforms for a wgmma operand whose rows hold `minor` elements: the widest swizzle that fits."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def mosaic_matmul_plan(x, values, scale, offset=None, *, bits: int, group_size: int, zero: int = 0,
                       interpret: bool = False):
    """(group_rows, value_rows) of the kernel's steps for these operands, or None when it cannot take them
    (quantized_matmul_mosaic would raise the ValueError saying why)."""
    try:
        return _plan(x, values, scale, offset, bits, group_size, interpret)
    except ValueError:
        return None


def _plan(x, values, scale, offset, bits, group_size, interpret):
    validate_quantized_matmul(x, values, scale, offset, bits, group_size)
    n = values.shape[1]
    if n % COLUMNS:
        raise ValueError(f"the weight's output size must be a multiple of {COLUMNS} for the Mosaic GPU kernel, "
                         f"got {n}")
    if x.dtype == jnp.float32 and not interpret:
        raise ValueError("the Mosaic GPU kernel runs bfloat16 or float16 activations on a GPU (float32 only in "
                         "interpret mode)")
    if x.shape[0] > 256:   # wgmma's N side (activation rows, padded to 8)
        raise ValueError(f"the Mosaic GPU kernel takes at most 256 activation rows, got {x.shape[0]}")
    # A step takes 64 or 128 rows of values (Mosaic's register tiles are 64 rows at least): one scale
    # group, part of a longer one, or several short ones (GGUF's groups of 32).
    group_rows = group_size // 2 if bits == 4 else group_size      # a group's rows of `values`
    single_group = group_rows == values.shape[0]    # per channel, or a row-parallel shard's one group
    value_rows = next((r for r in (_MAX_STEP_ROWS, 64) if group_rows % r == 0), 64)
    if not single_group and group_rows % value_rows and value_rows % group_rows:
        raise ValueError(f"group_size {group_size} does not tile 64 rows of values for the Mosaic GPU kernel")
    if values.shape[0] % value_rows:
        raise ValueError(f"the weight's {values.shape[0]} rows of values must be a multiple of {value_rows} for "
                         "the Mosaic GPU kernel")
    return group_rows, value_rows


def quantized_matmul_mosaic(x, values, scale, offset=None, *, bits: int, group_size: int, zero: int = 0,
                            interpret: bool = False, max_slots: int = _MAX_SLOTS,
                            num_splits: int | None = None) -> jax.Array:
    """x [M, K] @ the quantized [K, N] weight -> [M, N] in x's dtype, fp32 accumulation. `num_splits`
    divides the K steps among programs (None: enough for a program per SM where the steps allow).
    Raises ValueError for shapes or dtypes the kernel cannot handle."""
    group_rows, value_rows = _plan(x, values, scale, offset, bits, group_size, interpret)
    if max_slots < 2:
        raise ValueError(f"max_slots must be >= 2, got {max_slots}")
    num_steps = values.shape[0] // value_rows
    if num_splits is None:
        num_splits = default_splits(values.shape[1] // COLUMNS, num_steps)
    if num_splits < 1 or num_steps % num_splits:
        raise ValueError(f"num_splits must be >= 1 and divide the weight's {num_steps} steps of {value_rows} rows, "
                         f"got {num_splits}")
    return _matmul(x, values, scale, offset, bits=bits, group_rows=group_rows, zero=zero, value_rows=value_rows,
                   interpret=interpret, max_slots=max_slots, splits=num_splits)


def default_splits(column_programs: int, num_steps: int, sms: int | None = None) -> int:
    """The fewest splits of the K steps (a divisor of them, leaving at least 4 steps a split so the ring
    stays full) that give every SM a program; 1 when the columns alone do."""
    sms = sms or getattr(jax.devices()[0], "core_count", None) or _SMS
    splits = 1
    for candidate in range(2, num_steps // 4 + 1):
        if column_programs * splits >= sms:
            break
        if num_steps % candidate == 0:
            splits = candidate
    return splits


@functools.partial(jax.jit, static_argnames=("bits", "group_rows", "zero", "value_rows", "interpret", "max_slots",
                                             "splits"))
def _matmul(x, values, scale, offset, *, bits, group_rows, zero, value_rows, interpret, max_slots, splits):
    m, k = x.shape
    n = values.shape[1]
    padded_m = max(8, -(-m // 8) * 8)
    x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
    # 4-bit: even and odd input columns meet the low and high nibbles
    xs = [x[:, 0::2], x[:, 1::2]] if bits == 4 else [x]
    # per channel, a Q4_1 offset, or a GGUF zero: one scale (and offset) row per step, [groups, N]
    has_offset = offset is not None
    operands = [*xs, values, scale.astype(jnp.float32)] + ([offset.astype(jnp.float32)] if has_offset else [])
    step_bytes = (padded_m * value_rows * len(xs) * x.dtype.itemsize + value_rows * COLUMNS * values.dtype.itemsize)
    num_steps = values.shape[0] // value_rows // splits
    slots = max(2, min(max_slots, num_steps + 1, _SMEM_BYTES // step_bytes))
    program = functools.partial(_program, bits=bits, group_rows=group_rows, zero=zero, value_rows=value_rows,
                                slots=slots, num_steps=num_steps, has_offset=has_offset)
    out_dtype = x.dtype if splits == 1 else jnp.float32      # partials stay fp32 until summed
    out_t = plgpu.kernel(
        program, out_type=jax.ShapeDtypeStruct((splits * n, padded_m), out_dtype),
        grid=(n // COLUMNS, splits), grid_names=("column", "split"),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(*operands)
    out_t = out_t.reshape(splits, n, padded_m).sum(0).astype(x.dtype)
    return out_t[:, :m].T


def _program(*refs, bits, group_rows, zero, value_rows, slots, num_steps, has_offset):
    num_x = 2 if bits == 4 else 1
    x_refs, (values_ref, scale_ref, *rest) = refs[:num_x], refs[num_x:]
    offset_ref = rest[0] if has_offset else None
    out_ref = rest[-1]
    dtype, padded_m = x_refs[0].dtype, x_refs[0].shape[0]
    groups = max(1, value_rows // group_rows)      # scale rows a step reads
    column, split = lax.axis_index("column"), lax.axis_index("split")
    columns = pl.ds(column * COLUMNS, COLUMNS)
    first_step = split * num_steps              # this split's share of the K steps

    def walk(x_smem, v_smem, w_smem, s_smem, barriers, *o_smem):
        o_smem = o_smem[0] if has_offset else None

        def issue(step):
            slot = lax.rem(step, slots)
            step = first_step + step
            for i, x_ref in enumerate(x_refs):
                plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(step * value_rows, value_rows)], x_smem.at[i, slot],
                                        barriers.at[slot])
            plgpu.copy_gmem_to_smem(values_ref.at[pl.ds(step * value_rows, value_rows), columns], v_smem.at[slot],
                                    barriers.at[slot])
            first_group = pl.ds(step * value_rows // group_rows, groups)
            plgpu.copy_gmem_to_smem(scale_ref.at[first_group, columns], s_smem.at[slot], barriers.at[slot])
            if has_offset:
                plgpu.copy_gmem_to_smem(offset_ref.at[first_group, columns], o_smem.at[slot], barriers.at[slot])

        for step in range(min(slots - 1, num_steps)):
            issue(step)

        def per_row(rows_ref):
            """[groups, 64] scale (or offset) rows -> [value_rows, 64], each value row its group's."""
            out = lax.broadcast_in_dim(rows_ref[0], (value_rows, COLUMNS), [1])
            if groups > 1:
                row = lax.broadcasted_iota(jnp.int32, (value_rows, COLUMNS), 0)
                for g in range(1, groups):
                    out = jnp.where(row >= g * group_rows, lax.broadcast_in_dim(rows_ref[g], out.shape, [1]), out)
            return out

        def body(step, acc):
            @pl.when(step + slots - 1 < num_steps)
            def _prefetch():                       # into the slot the previous step finished with
                issue(step + slots - 1)

            slot = lax.rem(step, slots)
            plgpu.barrier_wait(barriers.at[slot])
            v = v_smem[slot]
            s, o = per_row(s_smem.at[slot]), per_row(o_smem.at[slot]) if has_offset else None
            if bits == 4:
                v = v.astype(jnp.int32)       # Mosaic has no 8-bit arithmetic but bitwise
                tiles = [v & 15, lax.shift_right_logical(v, 4)]
            else:
                tiles = [v]
            for i, tile in enumerate(tiles):
                t = tile.astype(jnp.float32)
                if zero:
                    t = t - zero
                t = t * s
                if has_offset:
                    t = t + o
                w_smem[i][...] = t.astype(dtype)
            plgpu.commit_smem()

            def dot(acc_ref):
                for i in range(len(tiles)):
                    plgpu.wgmma(acc_ref, w_smem[i].T, x_smem.at[i, slot].T)
                return acc_ref[...]
            return acc + pl.run_scoped(dot, plgpu.ACC((COLUMNS, padded_m), jnp.float32))

        acc = plgpu.layout_cast(jnp.zeros((COLUMNS, padded_m), jnp.float32), plgpu.Layout.WGMMA)
        return lax.fori_loop(0, num_steps, body, acc)

    acc = pl.run_scoped(
        walk,
        plgpu.SMEM((num_x, slots, padded_m, value_rows), dtype, transforms=_swizzled(dtype, value_rows)),
        plgpu.SMEM((slots, value_rows, COLUMNS), values_ref.dtype),
        [plgpu.SMEM((value_rows, COLUMNS), dtype, transforms=_swizzled(dtype, COLUMNS)) for _ in range(num_x)],
        plgpu.SMEM((slots, groups, COLUMNS), jnp.float32),
        plgpu.Barrier(num_arrivals=num_x + 2 + has_offset, num_barriers=slots),
        *([plgpu.SMEM((slots, groups, COLUMNS), jnp.float32)] if has_offset else []))

    def store(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        first_row = (split * (values_ref.shape[1] // COLUMNS) + column) * COLUMNS
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(first_row, COLUMNS)])
        plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(store, plgpu.SMEM((COLUMNS, padded_m), out_ref.dtype))
