"""The Triton kernel's launch replayed in numpy, program by program (same operands, grid, key
ranges, masks, dot input dtypes, output slots), from exactly what `triton_call` is given; and a
stand-in `jax_triton` module whose `triton_call` runs that replay through `jax.pure_callback`, so
that a whole model can run the Triton backend's code path on a CPU. Slow; tiny shapes only."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.layout import fp8_values
from jaxpaged.kernels.triton_attention import TritonLaunch, compute_dtype


def replay(operands, launch: TritonLaunch, sm_scale: float):
    """(acc, m, l) of every program's output slot, as the kernel writes them."""
    q, pool, (layer,), (window,), (cap,), kv_lens, tables, cu_q_lens, tile_seq, tile_first_row, tile_rows = (
        np.asarray(x) for x in operands)
    pages = np.asarray(fp8_values(jnp.asarray(pool[layer])))   # [2, num_blocks, kv_heads, block_size, head_dim]
    dots = compute_dtype(q.dtype, pool.dtype)                  # the dots' input dtype
    queries = q.astype(dots).astype(np.float32)
    group, rows, chunk, block_size = launch.group, launch.rows, launch.chunk_tokens, launch.block_size
    live_rows, masked = launch.q_tile * group, np.float32(-1e30)    # the kernel's mask value
    acc = np.zeros((launch.num_tiles, launch.kv_heads, launch.num_splits, launch.row_blocks * rows,
                    launch.head_dim_pad), np.float32)                       # the kernel's output slots
    m_out, l_out = np.full(acc.shape[:-1], masked), np.zeros(acc.shape[:-1], np.float32)
    for program in np.ndindex(*launch.grid):
        (tile, row_block), kv_head, split = divmod(program[0], launch.row_blocks), program[1], program[2]
        seq, first_row, num_rows = tile_seq[tile], tile_first_row[tile], tile_rows[tile]
        kv_len, q_start = kv_lens[seq], cu_q_lens[seq]
        pos_offset = kv_len - (cu_q_lens[seq + 1] - q_start) + first_row
        r = row_block * rows + np.arange(rows)
        row = r // group
        row_ok = (r < live_rows) & (row < num_rows)
        q_pos = pos_offset + row
        qt = np.zeros((rows, launch.head_dim), np.float32)
        qt[row_ok] = queries[q_start + first_row + row[row_ok], kv_head * group + r[row_ok] % group]

        start_row = row_block * rows // group
        end_row = min(-(-min((row_block + 1) * rows, live_rows) // group), num_rows)
        hi = pos_offset + end_row
        lo = max(pos_offset + start_row - window + 1, 0) if window > 0 else 0
        chunk_lo = lo // chunk
        chunk_hi = -(-hi // chunk) if end_row > start_row and hi > lo else chunk_lo
        per_split = -(-(chunk_hi - chunk_lo) // launch.num_splits)
        chunk_begin = chunk_lo + split * per_split
        m_i, l_i = np.full(rows, masked), np.zeros(rows, np.float32)
        acc_i = np.zeros((rows, launch.head_dim), np.float32)
        for c in range(chunk_begin, min(chunk_begin + per_split, chunk_hi)):
            k_pos = c * chunk + np.arange(chunk)
            k_ok = (k_pos < kv_len) & (k_pos // block_size < launch.max_blocks)
            block_id = np.where(k_ok, tables[seq, np.minimum(k_pos // block_size, launch.max_blocks - 1)], 0)
            k, v = (np.where(k_ok[:, None], pages[kv, block_id, kv_head, k_pos % block_size].astype(dots),
                             0).astype(np.float32) for kv in (0, 1))
            s = (qt @ k.T) * np.float32(sm_scale)
            if cap > 0:
                with np.errstate(over="ignore"):
                    s = cap * (1.0 - 2.0 / (np.exp(2.0 * (s / cap)) + 1.0))
            mask = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if window > 0:
                mask &= q_pos[:, None] - k_pos[None, :] < window
            s = np.where(mask, s, masked).astype(np.float32)
            m_new = np.maximum(m_i, s.max(axis=1))
            p = np.where(mask, np.exp(s - m_new[:, None]), 0.0).astype(np.float32)
            alpha = np.exp(m_i - m_new)
            l_i = l_i * alpha + p.sum(axis=1)
            acc_i = acc_i * alpha[:, None] + p.astype(dots).astype(np.float32) @ v
            m_i = m_new
        slots = (tile, kv_head, split, slice(row_block * rows, (row_block + 1) * rows))
        acc[slots][:, :launch.head_dim], m_out[slots], l_out[slots] = acc_i, m_i, l_i
    return acc, m_out, l_out


def _launch_from_call(grid, meta) -> TritonLaunch:
    """The launch plan back from triton_call's grid and constexprs (what the kernel itself sees)."""
    launch = TritonLaunch(num_tiles=grid[0] // meta["ROW_BLOCKS"], num_heads=meta["NUM_HEADS"],
                          kv_heads=meta["KV_HEADS"], group=meta["GROUP"], q_tile=meta["Q_TILE"], rows=meta["ROWS"],
                          row_blocks=meta["ROW_BLOCKS"], head_dim=meta["HEAD_DIM"], head_dim_pad=meta["HEAD_DIM_PAD"],
                          block_size=meta["BLOCK_SIZE"], num_blocks=meta["NUM_BLOCKS"], max_blocks=meta["MAX_BLOCKS"],
                          chunk_blocks=meta["CHUNK"] // meta["BLOCK_SIZE"], num_splits=meta["NUM_SPLITS"])
    assert launch.grid == tuple(grid)
    return launch


def fake_jax_triton(output_keyword: str = "out_type") -> types.ModuleType:
    """A `jax_triton` whose triton_call replays the kernel on the host (inside jit, per call).
    output_keyword: what its triton_call names the output shapes, `out_type` as jax-triton 0.4 or
    `out_shape` as 0.3 (the one that pairs with the GPU image's triton 3.6)."""
    def launch_replay(operands, out, grid, meta):
        launch = _launch_from_call(grid, meta)

        def host(*arrays):
            acc, m, l = replay(arrays, launch, meta["SM_SCALE"])
            return acc.reshape(-1, launch.head_dim_pad), m.reshape(-1), l.reshape(-1)
        return jax.pure_callback(host, out, *operands)

    def triton_call_04(*operands, kernel, out_type, grid, name, num_warps, num_stages, compute_capability, **meta):
        return launch_replay(operands, out_type, grid, meta)

    def triton_call_03(*operands, kernel, out_shape, grid, name, num_warps, num_stages, compute_capability, **meta):
        return launch_replay(operands, out_shape, grid, meta)
    module = types.ModuleType("jax_triton")
    module.triton_call = {"out_type": triton_call_04, "out_shape": triton_call_03}[output_keyword]
    return module
