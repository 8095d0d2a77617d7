"""Attention parts: each backend against the jnp reference on mixed batches, and decode timing vs bandwidth.

Correctness batches are what the engine hands a kernel in one step, made hostile in the way
tests/kernels/cases.py is (pages scattered through a shuffled pool, garbage in every slot that
is not live KV, in the other layer and past kv_len; NaN in padded query tokens) but at
realistic sizes, built on the device. The ground truth is the reference at 'highest' matmul
precision: on a GPU, XLA's default fp32 dots (the reference as a backend) use TF32.
"""

import dataclasses
import functools
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check.common import Context, Row, error_row, guarded, time_call
from jaxpaged.runner.batch_builder import PREFILL_Q_TILE
from jaxpaged.kernels import AttentionMetadata, kv_pool_shape
from jaxpaged.kernels.backends import get_attention, resolve_backend
from jaxpaged.kernels.reference import ragged_paged_attention_reference

BACKENDS = ("reference", "pallas", "triton", "pallas_triton")
# ||out - truth|| / ||truth|| (METHOD.md): fp32 lands far under 1e-3 even with TF32 dots (~3e-4),
# bf16 operands between 1e-3 and 1e-2; a wrong page or mask is off by O(1).
REL_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2}
_IEEE_FP32 = 1e-5   # above this an fp32 result is TF32-level, not IEEE: said in the row's note


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's attention work: live sequences (q_len, kv_len), then padded ones (0, 0)."""

    name: str
    heads: tuple[int, int, int]   # (q heads, kv heads, head_dim)
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_tile: int
    decode_only: bool = False
    sliding_window: int = 0
    soft_cap: float = 0.0
    sinks: bool = False           # gpt-oss's attention sinks: a logit per q head, from -2 to 6


def correctness_batches(ctx: Context) -> list[Batch]:
    sizes = ctx.sizes
    longest, bs = sizes.correctness_context, sizes.block_size
    num_decodes, num_chunks, decode_batch = sizes.correctness_seqs
    rng = np.random.default_rng(0)

    def decodes(n):   # block boundaries and one past them, then anywhere up to `longest`
        fixed = [bs, bs + 1, longest, 1]
        return fixed[:n] + rng.integers(1, longest + 1, max(0, n - len(fixed))).tolist()

    def mixed(name, heads, **kw):
        chunk_q = rng.integers(2, max(3, min(300, longest // 2)), num_chunks).tolist()
        prefixes = [0] + rng.integers(0, longest // 2, num_chunks - 1).tolist()   # a fresh prompt, then later chunks
        q_lens = [1] * num_decodes + chunk_q + [0, 0]
        kv_lens = decodes(num_decodes) + [q + p for q, p in zip(chunk_q, prefixes)] + [0, 0]
        return Batch(name, heads, tuple(q_lens), tuple(kv_lens), PREFILL_Q_TILE, **kw)

    first = sizes.correctness_heads[0]
    batches = [mixed(f"mixed {h}/{k} d{d}", (h, k, d)) for h, k, d in sizes.correctness_heads]
    batches.append(Batch(f"decode {first[0]}/{first[1]} d{first[2]}", first, (1,) * decode_batch + (0,) * 3,
                         tuple(decodes(decode_batch)) + (0,) * 3, 1, decode_only=True))
    batches.append(mixed(f"mixed {first[0]}/{first[1]} d{first[2]} window+cap", first,
                         sliding_window=max(2, longest // 6), soft_cap=30.0))
    batches.append(mixed(f"mixed {first[0]}/{first[1]} d{first[2]} window+sinks", first,
                         sliding_window=max(2, longest // 6), sinks=True))
    return batches


def build_inputs(batch: Batch, dtype, block_size: int, seed: int, num_layers: int = 2, pad_tokens: int = 3):
    """(q, kv_pool, layer, md, kwargs) for kernel(q, kv_pool, layer, md, **kwargs); the last layer is read."""
    num_heads, kv_heads, head_dim = batch.heads
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(batch.kv_lens)
    blocks_per_seq = -(-kv_lens // block_size)
    num_blocks = 1 + int(blocks_per_seq.sum()) + 3          # block 0 is the null block; 3 free blocks
    tables = np.zeros((len(kv_lens), int(blocks_per_seq.max()) + 1), np.int32)   # + a padding column
    free = rng.permutation(np.arange(1, num_blocks))
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n], free = free[:n], free[n:]
    owner = np.repeat(np.arange(len(kv_lens)), kv_lens)
    position = np.concatenate([np.arange(n) for n in kv_lens])
    layer = num_layers - 1
    q, pool = _random_q_and_pool(seed, layer, tables[owner, position // block_size],
                                 (position % block_size).astype(np.int32), num_tokens=sum(batch.q_lens),
                                 pad_tokens=pad_tokens, q_heads=num_heads, dtype=dtype,
                                 pool_shape=kv_pool_shape(num_layers, num_blocks, block_size, kv_heads, head_dim))
    # numpy arrays of the final dtype: on CPU every eager jnp conversion is a ~1 s compile
    md = AttentionMetadata(kv_lens=jnp.asarray(kv_lens.astype(np.int32)), block_tables=jnp.asarray(tables),
                           cu_q_lens=jnp.asarray(np.cumsum([0, *batch.q_lens], dtype=np.int32)),
                           q_tile=batch.q_tile, decode_only=batch.decode_only)
    kwargs = dict(sliding_window=np.int32(batch.sliding_window), soft_cap=batch.soft_cap,
                  sm_scale=head_dim ** -0.5)
    if batch.sinks:
        kwargs["sinks"] = np.linspace(-2.0, 6.0, num_heads, dtype=np.float32)
    return q, pool, np.int32(layer), md, kwargs


@functools.partial(jax.jit, static_argnames=("num_tokens", "pad_tokens", "q_heads", "dtype", "pool_shape"))
def _random_q_and_pool(seed, layer, live_blocks, live_offsets, *, num_tokens, pad_tokens, q_heads, dtype,
                       pool_shape):
    """Garbage everywhere in the pool but at the live slots (N(0, 1) K and V); q N(0, 1), NaN past num_tokens."""
    head_dim = pool_shape[-1]
    keys = jax.random.split(jax.random.key(seed, impl="rbg"), 3)   # threefry compiles for seconds on CPU
    pool = jax.random.uniform(keys[0], pool_shape, jnp.float32, -1e3, 1e3)
    live = jax.random.normal(keys[1], (live_blocks.shape[0], 2, pool_shape[3], head_dim), jnp.float32)
    pool = pool.at[layer, :, live_blocks, :, live_offsets].set(live)
    q = jax.random.normal(keys[2], (num_tokens + pad_tokens, q_heads, head_dim), jnp.float32)
    q = q.at[num_tokens:].set(jnp.nan)   # padded tokens: a kernel that lets them leak fails every row
    return q.astype(dtype), pool.astype(dtype)


def backend_kernel(name: str, platform: str) -> Callable | str:
    """The backend's attention function, or why it cannot run here."""
    try:
        resolved = resolve_backend(name, platform)
    except ValueError as exc:
        return str(exc)
    return get_attention(resolved, platform)


def _note(platform: str, name: str) -> str:
    return "interpret mode" if platform != "gpu" and name.startswith("pallas") else ""


def _timed_kernels(platform: str, head_dim: int) -> dict:
    """Each backend's attention jitted at this head_dim's scale, or why it cannot run here."""
    kernels = {name: backend_kernel(name, platform) for name in BACKENDS}
    return {name: k if isinstance(k, str) else jax.jit(functools.partial(k, sm_scale=head_dim ** -0.5))
            for name, k in kernels.items()}


def _unavailable(part: str, case: str, reason: str, platform: str) -> Row:
    # On CPU a GPU-only backend is expected to be missing; on the GPU it is the thing to fix.
    return Row(part, case, "error" if platform == "gpu" else "skip", note=reason)


def kernel_correctness(ctx: Context) -> Iterator[Row]:
    platform = jax.devices()[0].platform
    kernels = {name: backend_kernel(name, platform) for name in BACKENDS}
    for b, batch in enumerate(correctness_batches(ctx)):
        for dtype in ctx.sizes.correctness_dtypes:
            try:
                q, pool, layer, md, kwargs = build_inputs(batch, dtype, ctx.sizes.block_size, seed=b)
                with jax.default_matmul_precision("highest"):
                    truth = ragged_paged_attention_reference(q, pool, layer, md, **kwargs)
                truth = np.asarray(truth, np.float64)[:sum(batch.q_lens)]
            except Exception as exc:  # noqa: BLE001 -- this batch is lost, not the next ones
                yield error_row("kernels", f"inputs {batch.name} {dtype}", exc)
                continue
            for name, kernel in kernels.items():
                case = f"{name} {batch.name} {dtype}"
                if isinstance(kernel, str):
                    yield _unavailable("kernels", case, kernel, platform)
                    continue
                yield guarded("kernels", case, functools.partial(
                    _compare, case, kernel, (q, pool, layer, md), kwargs, truth, dtype, platform))


def _compare(case, kernel, args, kwargs, truth, dtype, platform) -> Row:
    out = np.asarray(kernel(*args, **kwargs), np.float64)[:len(truth)]
    metrics = {"tokens": len(truth)}
    if not np.isfinite(out).all():
        bad = np.unique(np.nonzero(~np.isfinite(out))[0])
        return Row("kernels", case, "fail", metrics, note=f"non-finite output rows {bad[:8].tolist()}")
    max_abs = float(np.abs(out - truth).max())
    rel = float(np.linalg.norm(out - truth) / np.linalg.norm(truth))
    tol = REL_TOLERANCE[dtype]
    note = _note(platform, case.split()[0])
    if dtype == "float32" and rel > _IEEE_FP32:
        note = "fp32 at TF32 level, not IEEE"
    return Row("kernels", case, "ok" if rel <= tol else "fail",
               {**metrics, "max abs err": max_abs, "rel err": rel, "rel tol": tol}, note=note)


def decode_batch(num_seqs: int, context: int, heads: tuple[int, int, int], block_size: int, seed: int = 0):
    """A decode step of num_seqs sequences of `context` tokens over one layer, pages shuffled."""
    num_heads, kv_heads, head_dim = heads
    per_seq = -(-context // block_size)
    num_blocks = 1 + num_seqs * per_seq
    q, pool = _random_decode(seed, q_shape=(num_seqs, num_heads, head_dim),
                             pool_shape=kv_pool_shape(1, num_blocks, block_size, kv_heads, head_dim))
    tables = np.random.default_rng(seed).permutation(np.arange(1, num_blocks, dtype=np.int32))
    md = AttentionMetadata(kv_lens=jnp.asarray(np.full(num_seqs, context, np.int32)),
                           block_tables=jnp.asarray(tables.reshape(num_seqs, per_seq)),
                           cu_q_lens=jnp.asarray(np.arange(num_seqs + 1, dtype=np.int32)), q_tile=1, decode_only=True)
    kv_bytes = num_seqs * context * kv_heads * head_dim * 2 * pool.dtype.itemsize   # K and V of every context
    return (q, pool, np.int32(0), md), kv_bytes


@functools.partial(jax.jit, static_argnames=("q_shape", "pool_shape"))
def _random_decode(seed, *, q_shape, pool_shape):
    keys = jax.random.split(jax.random.key(seed, impl="rbg"), 2)
    return (jax.random.normal(keys[0], q_shape, jnp.bfloat16), jax.random.normal(keys[1], pool_shape, jnp.bfloat16))


def attention_timing(ctx: Context) -> Iterator[Row]:
    """Median time of one layer's decode attention per backend, against the KV bytes it must read: as a
    share of the device's read-only rate (the copy part's row sums; goal 85% for `pallas` at 64 and 256
    sequences), and of its read + write rate (an elementwise op) as earlier runs reported it."""
    sizes = ctx.sizes
    platform = jax.devices()[0].platform
    copy = [r.data["gbps"] for r in ctx.rows_of("copy") if "gbps" in r.data]
    copy_gbps = copy[0] if copy else None
    read = [r.data["read_gbps"] for r in ctx.rows_of("copy") if "read_gbps" in r.data]
    read_gbps = read[0] if read else None
    kernels = _timed_kernels(platform, sizes.attention_heads[2])
    for num_seqs in sizes.attention_seqs:
        for context in sizes.attention_contexts:
            try:
                args, kv_bytes = decode_batch(num_seqs, context, sizes.attention_heads, sizes.block_size)
            except Exception as exc:  # noqa: BLE001 -- e.g. out of memory: the smaller cases still ran
                yield error_row("attention", f"inputs {num_seqs} seqs x {context}", exc)
                continue
            reference_out = None
            for name, fn in kernels.items():
                case = f"{name} {num_seqs} seqs x {context}"
                if isinstance(fn, str):
                    yield _unavailable("attention", case, fn, platform)
                    continue

                def run(case=case, fn=fn, name=name):
                    nonlocal reference_out
                    seconds = time_call(fn, *args, rounds=sizes.timing_rounds, round_s=sizes.timing_round_s)
                    out = np.asarray(fn(*args), np.float32)
                    metrics = {"ms": seconds * 1e3, "KV MB": kv_bytes / 1e6, "GB/s": kv_bytes / seconds / 1e9}
                    if read_gbps:
                        metrics["of read"] = kv_bytes / seconds / 1e9 / read_gbps
                    if copy_gbps:
                        metrics["of copy"] = kv_bytes / seconds / 1e9 / copy_gbps
                    if name == "reference":
                        reference_out = out
                    elif reference_out is not None:
                        metrics["max diff vs ref"] = float(np.abs(out - reference_out).max())
                    return Row("attention", case, "ok", metrics, note=_note(platform, name),
                               data={"seconds": seconds, "kv_bytes": kv_bytes})

                yield guarded("attention", case, run)
            args = None   # let the batch go before the next one is built


# Dense bf16 tensor-core peaks (NVIDIA's data sheets, without sparsity), by device kind.
_BF16_PEAK_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L4", 121.0))


def prefill_attention_timing(ctx: Context) -> Iterator[Row]:
    """One prompt's causal attention over its own KV (prefill_context tokens, the engine's q tiles):
    median ms and TFLOP/s (2 matmuls x 2 flops x visible keys x head_dim x heads), as a share of the
    device's bf16 tensor-core peak (goal 60% for `pallas` at head_dim 128 and 4k tokens)."""
    sizes = ctx.sizes
    platform = jax.devices()[0].platform
    num_heads, kv_heads, head_dim = sizes.attention_heads
    tokens, block_size = sizes.prefill_context, sizes.block_size
    pages = -(-tokens // block_size)
    q, pool = _random_decode(1, q_shape=(tokens, num_heads, head_dim),
                             pool_shape=kv_pool_shape(1, pages + 1, block_size, kv_heads, head_dim))
    md = AttentionMetadata(kv_lens=jnp.asarray([tokens], jnp.int32),
                           block_tables=jnp.asarray(np.random.default_rng(1).permutation(np.arange(1, pages + 1))
                                                    .astype(np.int32)[None]),
                           cu_q_lens=jnp.asarray([0, tokens], jnp.int32), q_tile=PREFILL_Q_TILE)
    flops = 4 * num_heads * head_dim * tokens * (tokens + 1) / 2
    kind = jax.devices()[0].device_kind
    peak = next((tf for name, tf in _BF16_PEAK_TFLOPS if name in kind), None) if platform == "gpu" else None
    for name, fn in _timed_kernels(platform, head_dim).items():
        case = f"{name} prefill {tokens} tokens, head_dim {head_dim}"
        if isinstance(fn, str):
            yield _unavailable("attention", case, fn, platform)
            continue

        def run(fn=fn, case=case, name=name):
            seconds = time_call(fn, q, pool, np.int32(0), md, rounds=sizes.timing_rounds, round_s=sizes.timing_round_s)
            metrics = {"ms": seconds * 1e3, "TFLOP/s": flops / seconds / 1e12}
            if peak:
                metrics["of peak"] = flops / seconds / 1e12 / peak
            return Row("attention", case, "ok", metrics, note=_note(platform, name),
                       data={"seconds": seconds, "flops": flops})

        yield guarded("attention", case, run)


def quantized_matmul_timing(ctx: Context) -> Iterator[Row]:
    """The W8A16 / W4A16 kernels (Mosaic GPU; the Pallas one through Triton) against the bf16 matmul (XLA)
    and de-quantize-then-matmul, at decode-shaped row counts: median ms, and the weight bytes read per
    second as a share of the device's read-only rate (the copy part's; goal: at least as fast as bf16 at
    1-16 rows, near the int8 / int4 bytes floor). Where the Mosaic kernel splits K, it runs unsplit too."""
    sizes = ctx.sizes
    for k, n in sizes.qmm_shapes:
        w = np.random.default_rng(0).standard_normal((k, n), np.float32) * 0.02
        for mode in ("int8", "int4"):
            yield from _quantized_matmul_rows(ctx, w, mode)


def _quantized_matmul_rows(ctx: Context, w: np.ndarray, mode: str) -> Iterator[Row]:
    from jaxpaged.kernels.backends import has_wgmma
    from jaxpaged.kernels.mosaic_matmul import COLUMNS, default_splits, mosaic_matmul_plan, quantized_matmul_mosaic
    from jaxpaged.kernels.quantized_matmul import quantized_matmul_pallas, quantized_matmul_reference
    from jaxpaged.models.quantization import quantize

    sizes = ctx.sizes
    interpret = jax.devices()[0].platform != "gpu"
    read = [r.data["read_gbps"] for r in ctx.rows_of("copy") if "read_gbps" in r.data]
    k, n = w.shape
    dense = jnp.asarray(w, jnp.bfloat16)
    q = quantize(w, mode).packed()
    arrays = tuple(None if a is None else jnp.asarray(a) for a in (q.values, q.scale, q.offset))
    statics = dict(bits=q.bits, group_size=q.group_size, zero=q.zero)
    mosaic = functools.partial(quantized_matmul_mosaic, **statics, interpret=interpret)
    kernels = {"mosaic": mosaic, "mosaic unsplit": functools.partial(mosaic, num_splits=1),
               "triton-lowered": functools.partial(quantized_matmul_pallas, **statics, interpret=interpret)}
    kernels = {name: jax.jit(kernel) for name, kernel in kernels.items()}
    dequantizing = jax.jit(functools.partial(quantized_matmul_reference, **statics))
    q_bytes = sum(a.nbytes for a in arrays if a is not None)
    for rows in sizes.qmm_rows:
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)), jnp.bfloat16)
        case = f"w{q.bits}a16 {rows} rows x {k}x{n}"
        plan = mosaic_matmul_plan(x, *arrays, **statics, interpret=interpret) if interpret or has_wgmma() else None
        split = plan is not None and not interpret and default_splits(n // COLUMNS, arrays[0].shape[0] // plan[1]) > 1
        names = [name for name in kernels if (name == "triton-lowered" or plan is not None)
                 and (name != "mosaic unsplit" or split)]

        def run(case=case, x=x, names=names, plan=plan):
            timed = functools.partial(time_call, rounds=sizes.timing_rounds, round_s=sizes.timing_round_s)
            bf16_s = timed(jax.jit(lambda x, w: x @ w), x, dense)
            deq_s = timed(dequantizing, x, *arrays)
            want = dequantizing(x, *arrays).astype(jnp.float32)
            metrics = {"bf16 ms": bf16_s * 1e3, "dequant ms": deq_s * 1e3}
            data = {"bf16_s": bf16_s, "dequant_s": deq_s, "weight_bytes": q_bytes}
            for name in names:
                kernel = kernels[name]
                seconds = timed(kernel, x, *arrays)
                metrics |= {f"{name} ms": seconds * 1e3, f"{name} vs bf16": bf16_s / seconds,
                            f"{name} weight GB/s": q_bytes / seconds / 1e9,
                            f"{name} max diff vs dequant": float(jnp.abs(kernel(x, *arrays) - want).max())}
                if read:
                    metrics[f"{name} of read"] = q_bytes / seconds / 1e9 / read[0]
                data[f"{name}_s"] = seconds
            note = "interpret mode" if interpret else "" if plan is not None else "mosaic: not on this GPU or shape"
            return Row("qmatmul", case, "ok", metrics, note=note, data=data)

        yield guarded("qmatmul", case, run)


def sampler_layout_timing(ctx: Context) -> Iterator[Row]:
    """The sampler's two layouts (jaxpaged.runner.sampler.SamplerLayout): the default (XLA's argmax and
    float sort over [rows, vocab] logits) against the one XLA:CPU runs faster (a vocabulary-major LM
    head and greedy, the masked argmax, integer sort keys), at decode-sized row counts: median ms of a
    plain-greedy step's LM head + greedy, and of a full descending sort, each way. `for_platform`
    takes the faster where these rows say so."""
    from jaxpaged.runner.sampler import SamplerLayout, plain_greedy

    sizes = ctx.sizes
    hidden_size, vocab = sizes.sampler_shape
    head = jnp.asarray(np.random.default_rng(0).standard_normal((vocab, hidden_size)) * 0.02, jnp.bfloat16)
    layouts = {"default": SamplerLayout(), "cpu-measured": SamplerLayout.for_platform("cpu")}

    def greedy(layout, h, e):
        if layout.vocab_major_greedy:
            return plain_greedy((e @ h.T).astype(jnp.float32), 0, layout=layout).token_ids
        return plain_greedy((h @ e.T).astype(jnp.float32), 1, layout=layout).token_ids

    for rows in sizes.sampler_rows:
        h = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, hidden_size)), jnp.bfloat16)
        logits = jnp.asarray(np.random.default_rng(rows + 1).standard_normal((rows, vocab)), jnp.float32)
        for name, layout in layouts.items():
            case = f"{name} layout, {rows} rows x {vocab} vocab"

            def run(case=case, layout=layout, h=h, logits=logits):
                greedy_fn = jax.jit(functools.partial(greedy, layout))
                sort_fn = jax.jit(layout.sort_descending)
                greedy_s = time_call(greedy_fn, h, head, rounds=sizes.timing_rounds, round_s=sizes.timing_round_s)
                sort_s = time_call(sort_fn, logits, rounds=sizes.timing_rounds, round_s=sizes.timing_round_s)
                # the same logits each way (the two matmul layouts may round a near-tie apart)
                axis = 0 if layout.vocab_major_greedy else 1
                ours = plain_greedy(logits.T if axis == 0 else logits, axis, layout=layout).token_ids
                same = bool(jnp.all(ours == plain_greedy(logits, 1).token_ids))
                status = "ok" if same else "fail"
                return Row("sampler", case, status, {"greedy ms": greedy_s * 1e3, "sort ms": sort_s * 1e3},
                           note="" if same else "greedy tokens differ from the default layout's",
                           data={"greedy_s": greedy_s, "sort_s": sort_s})

            yield guarded("sampler", case, run)
