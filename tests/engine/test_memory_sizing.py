"""KV-cache sizing from device memory: gpu_memory_utilization is a share of the whole device.

The GPU path runs on CPU with a fake memory report (GPU-like `memory_stats`, a fake driver
total); the activation reserve comes from the real compiled step of a tiny model.
"""

import gc
import logging

import jax
import jax.numpy as jnp
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import memory
from jaxpaged.engine.memory import AllocatorConfig, MemoryReport, headroom_bytes, size_kv_cache
from jaxpaged.models.loader import load_model
from jaxpaged.runner.model_runner import ModelRunner
from tests.tiny_models import tiny_checkpoint

GiB, MiB = 1 << 30, 1 << 20
TOTAL = 80 * GiB
IN_USE = 2 * GiB           # weights
ACTIVATIONS = 1 * GiB
PER_BLOCK = 2 * MiB


def sizing(env: dict, report: MemoryReport, utilization: float = 0.9, activations: int = ACTIVATIONS):
    return size_kv_cache(report, AllocatorConfig.from_env(env), utilization, PER_BLOCK, activations,
                         max_num_batched_tokens=2048)


def report_from_stats(env: dict, stats: dict | None, driver_total: int | None, monkeypatch) -> MemoryReport:
    monkeypatch.setattr(memory, "memory_stats", lambda device: stats or {})
    monkeypatch.setattr(memory, "driver_total_bytes", lambda device: driver_total)
    return memory.read_memory_report(jax.devices()[0], AllocatorConfig.from_env(env))


# ---- the pure decision -----------------------------------------------------------------------
def test_default_preallocated_pool_caps_the_cache_and_says_what_to_set():
    """JAX started with its default 0.75 pool: 0.9 cannot be honoured, the pool is used and the
    warning names the variable and the value that would honour it."""
    pool = int(0.75 * TOTAL)
    out = sizing({}, MemoryReport(TOTAL, IN_USE, pool, pool - IN_USE))
    assert out.num_blocks == (pool - IN_USE - ACTIVATIONS - headroom_bytes(pool)) // PER_BLOCK
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in out.warning
    assert "gpu_memory_utilization=0.9" in out.warning and "unset" in out.warning


def test_fraction_equal_to_utilization_gives_90_percent_of_the_device():
    pool = int(0.9 * TOTAL)
    out = sizing({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, MemoryReport(TOTAL, IN_USE, pool, pool - IN_USE))
    assert out.warning is None
    assert out.num_blocks == (int(0.9 * TOTAL) - IN_USE - ACTIVATIONS - headroom_bytes(int(0.9 * TOTAL))) // PER_BLOCK


def test_a_larger_pool_than_the_utilization_uses_only_the_utilization():
    pool = int(0.95 * TOTAL)
    out = sizing({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}, MemoryReport(TOTAL, IN_USE, pool, pool - IN_USE))
    assert out.warning is None
    assert out.num_blocks == (int(0.9 * TOTAL) - IN_USE - ACTIVATIONS - headroom_bytes(int(0.9 * TOTAL))) // PER_BLOCK


def test_preallocate_off_still_caps_at_the_fraction(monkeypatch):
    """Without preallocation the BFC allocator grows, but only up to mem_fraction x total; its
    largest free block says nothing about room it has not reserved yet."""
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    limit = int(0.75 * TOTAL)
    stats = {"bytes_in_use": IN_USE, "bytes_limit": limit, "largest_free_block_bytes": 64 * MiB}
    report = report_from_stats(env, stats, TOTAL, monkeypatch)
    assert report == MemoryReport(TOTAL, IN_USE, limit, None)
    out = sizing(env, report)
    assert out.num_blocks == (limit - IN_USE - ACTIVATIONS - headroom_bytes(limit)) // PER_BLOCK
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in out.warning


def test_platform_allocator_has_no_cap_and_counts_live_arrays(monkeypatch):
    env = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    weights = jnp.ones((1024, 256), jnp.float32)   # a live array the report must count
    report = report_from_stats(env, None, TOTAL, monkeypatch)
    assert report.allocator_limit is None and report.largest_free_block is None
    assert report.bytes_in_use >= weights.nbytes
    out = sizing(env, report)
    assert out.warning is None
    assert out.num_blocks == (int(0.9 * TOTAL) - report.bytes_in_use - ACTIVATIONS
                              - headroom_bytes(int(0.9 * TOTAL))) // PER_BLOCK


def test_total_falls_back_to_the_pool_over_its_fraction(monkeypatch):
    report = report_from_stats({}, {"bytes_in_use": IN_USE, "bytes_limit": int(0.75 * TOTAL)}, None, monkeypatch)
    assert abs(report.total_bytes - TOTAL) <= 1


def test_no_limit_and_no_driver_asks_for_an_explicit_size(monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_memory_bytes or num_gpu_blocks_override"):
        report_from_stats({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, None, None, monkeypatch)


def test_the_pool_must_fit_in_the_largest_free_block():
    pool = int(0.9 * TOTAL)
    out = sizing({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, MemoryReport(TOTAL, IN_USE, pool, 10 * GiB))
    assert out.num_blocks == 10 * GiB // PER_BLOCK


def test_the_users_own_variable_is_the_one_named():
    env = {"XLA_CLIENT_MEM_FRACTION": "0.5"}
    out = sizing(env, MemoryReport(TOTAL, IN_USE, int(0.5 * TOTAL), None))
    assert "XLA_CLIENT_MEM_FRACTION=0.5" in out.warning      # how JAX was started
    assert "set XLA_CLIENT_MEM_FRACTION=0.9" in out.warning  # setting the other name too makes jaxlib refuse


def test_too_little_memory_names_the_arguments():
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1.*max_num_batched_tokens=2048"):
        sizing({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
               MemoryReport(TOTAL, 7 * GiB, int(0.9 * TOTAL), None), utilization=0.1)


# ---- setting the fraction before JAX starts -----------------------------------------------------
def test_fraction_is_preset_before_jax_starts():
    env = {}
    assert memory.preset_mem_fraction(0.9, env, jax_started=False, platforms="")
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    assert AllocatorConfig.from_env(env).mem_fraction == 0.9


@pytest.mark.parametrize("env, jax_started, platforms", [
    ({}, True, ""),                                            # too late: JAX read the fraction already
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, False, ""),    # the user's choice
    ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, False, ""),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, False, ""),  # no pool to size
    ({}, False, "cpu"),                                        # no GPU backend
])
def test_fraction_is_left_alone(env, jax_started, platforms):
    before = dict(env)
    assert memory.preset_mem_fraction(0.9, env, jax_started=jax_started, platforms=platforms) is None
    assert env == before


# ---- the compiled step -------------------------------------------------------------------------
@pytest.mark.parametrize("scan_layers", [False, True])
def test_step_temporaries_do_not_grow_with_the_pool(scan_layers):
    """The reserve is measured on a 2-block pool: that only holds if the step updates the pool
    in place (no pool-sized copy, not even one layer's slice of it)."""
    loaded = load_model(tiny_checkpoint("llama"), "float32", scan_layers=scan_layers)
    per_block = ModelRunner.bytes_per_block(loaded.config, 8, loaded.dtype)
    small, large = (ModelRunner(loaded.model, n, 8, 128, 8, 64) for n in (2, 256))
    assert small.kv_pool.nbytes == 2 * per_block
    shapes = memory.largest_buckets(small.warmup_shapes())
    assert {s.q_tile for s in shapes} == {1, 16} and max(s.num_tokens for s in shapes) == 64
    for shape in shapes:
        a, b = memory.step_memory(small, shape), memory.step_memory(large, shape)
        assert 0 < a.temp_bytes and b.temp_bytes - a.temp_bytes < per_block, shape
        assert a.input_bytes == b.input_bytes and a.output_bytes == b.output_bytes, shape


# ---- the engine, through the same path as on a GPU ----------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU dressed as a GPU: a memory report and a driver total; records the step reserve."""
    seen = {}
    reserve = memory.step_reserve_bytes
    monkeypatch.setattr(memory, "has_device_memory", lambda device: True)
    monkeypatch.setattr(memory, "step_reserve_bytes", lambda runner: seen.setdefault("reserve", reserve(runner)))
    for var in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.setenv(var, "")   # recorded, so whatever the engine sets is undone afterwards
        monkeypatch.delenv(var)

    def install(total, stats):
        monkeypatch.setattr(memory, "driver_total_bytes", lambda device: total)
        monkeypatch.setattr(memory, "memory_stats", lambda device: stats)
        return seen
    return install


def tiny_llm(**kwargs) -> LLM:
    return LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, max_model_len=128,
               compile_on_startup=False, **kwargs)


def tiny_per_block() -> int:
    loaded = load_model(tiny_checkpoint("llama"), "float32")
    return ModelRunner.bytes_per_block(loaded.config, 8, loaded.dtype)


def test_engine_takes_90_percent_of_the_device(fake_gpu, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")   # what the engine sets before JAX starts
    total, in_use = 96 * MiB, 16 * MiB
    pool = int(0.9 * total)
    seen = fake_gpu(total, {"bytes_in_use": in_use, "bytes_limit": pool, "largest_free_block_bytes": pool - in_use})
    llm = tiny_llm(gpu_memory_utilization=0.9)
    # the largest step's prompt logprobs alone return [max_num_batched_tokens, 2 + 2K] f32
    assert seen["reserve"] > 2048 * (2 + 2 * 20) * 4
    assert llm.llm_engine.num_blocks == (pool - in_use - seen["reserve"] - headroom_bytes(pool)) // tiny_per_block()


def test_engine_started_after_jax_sizes_to_the_pool_and_warns(fake_gpu, monkeypatch, caplog):
    """JAX already running with its default 0.75 pool and no driver to ask: the total comes from
    the pool, the cache from the pool, and the warning says what to set."""
    monkeypatch.setattr(memory, "_backends_initialized", lambda: True)
    total, in_use = 96 * MiB, 16 * MiB
    pool = int(0.75 * total)
    seen = fake_gpu(None, {"bytes_in_use": in_use, "bytes_limit": pool, "largest_free_block_bytes": pool - in_use})
    with caplog.at_level(logging.WARNING, logger="jaxpaged.engine.startup"):
        llm = tiny_llm(gpu_memory_utilization=0.9)
    assert llm.llm_engine.num_blocks == (pool - in_use - seen["reserve"] - headroom_bytes(pool)) // tiny_per_block()
    assert "set XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in caplog.text


def test_start_up_compiles_before_the_pool_takes_its_memory(fake_gpu, monkeypatch):
    """XLA's GPU autotuner times each matmul on copies of its operands while it compiles: with the
    pool (the whole memory budget) already allocated, an H200 start-up runs out of memory at its
    first step variant. Every start-up compilation runs with no pool on the device; the pool
    is there when LLM() returns."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    total, in_use = 96 * MiB, 16 * MiB
    pool = int(0.9 * total)
    fake_gpu(total, {"bytes_in_use": in_use, "bytes_limit": pool, "largest_free_block_bytes": pool - in_use})
    pools_during_compiles = []
    compile_step = ModelRunner.compile_step

    def watching(runner, shape):
        shape_of_pool = runner.kv_pool_spec.shape
        pools_during_compiles.append(sum(a.shape == shape_of_pool for a in jax.live_arrays() if not a.is_deleted()))
        return compile_step(runner, shape)
    monkeypatch.setattr(ModelRunner, "compile_step", watching)
    gc.collect()
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32)
    runner = llm.llm_engine.runner
    assert len(pools_during_compiles) > len(runner.warmup_shapes()) and not any(pools_during_compiles)
    assert [a for a in jax.live_arrays() if a.shape == runner.kv_pool_spec.shape and not a.is_deleted()]
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
