"""The prefix cache's host tier (kv_offloading_size, kv_offloading_backend="native"): multi-turn
conversations that a small device pool cannot hold between turns reload their history from host
memory instead of computing it, with the same greedy tokens; nothing leaks, bad arguments are
ValueErrors naming them, resets and new weights empty the tier."""

import functools

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.host_cache import HostPrefixCache
from tests.tiny_models import tiny_checkpoint

BLOCK = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_llm(**kwargs) -> LLM:
    opts = dict(dtype="float32", block_size=BLOCK, num_gpu_blocks_override=25, max_model_len=192,
                compile_on_startup=False, max_num_seqs=4)
    opts.update(kwargs)
    return LLM(tiny_checkpoint("llama"), **opts)


def conversations(num: int = 6, turns: int = 3, seed: int = 7):
    """Each conversation: a system prompt of its own, then user turns; history = all before."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(3, 320, int(rng.integers(20, 36))).tolist() for _ in range(turns)] for _ in range(num)]


def serve_turn_by_turn(llm: LLM, convs) -> tuple[list[list[int]], list[int]]:
    """Every conversation's turn t, then every turn t + 1 (histories grow with the answers):
    the tokens of every answer, and each request's num_cached_tokens."""
    histories = [[] for _ in convs]
    answers, cached = [], []
    for turn in range(len(convs[0])):
        prompts = [{"prompt_token_ids": h + c[turn]} for h, c in zip(histories, convs)]
        for i, out in enumerate(llm.generate(prompts, PARAMS, use_tqdm=False)):
            tokens = out.outputs[0].token_ids
            histories[i] = prompts[i]["prompt_token_ids"] + list(tokens)
            answers.append(list(tokens))
            cached.append(out.num_cached_tokens)
    return answers, cached


# 0.002 GiB holds 349 blocks of this tiny model (6 KiB each): every conversation's history
TIER_GIB = 0.002


@functools.cache
def without_tier():
    llm = make_llm()
    answers, cached = serve_turn_by_turn(llm, conversations())
    return answers, cached, llm.get_metrics()


def test_history_reloads_from_host_memory_with_the_same_tokens():
    llm = make_llm(kv_offloading_size=TIER_GIB, kv_offloading_backend="native")
    answers, cached = serve_turn_by_turn(llm, conversations())
    plain_answers, plain_cached, plain = without_tier()
    assert answers == plain_answers
    m = llm.get_metrics()
    assert m["jaxpaged:external_prefix_cache_hits_total"] > 0
    assert 0 < m["jaxpaged:external_prefix_cache_hits_total"] <= m["jaxpaged:external_prefix_cache_queries_total"]
    # a device pool of 24 blocks keeps little between turns; the tier gives it back, and
    # num_cached_tokens counts what came from host memory
    assert sum(cached) > 2 * sum(plain_cached)
    assert m["jaxpaged:prompt_tokens_total"] == plain["jaxpaged:prompt_tokens_total"]
    assert m["jaxpaged:kv_cache_usage_perc"] == 0.0
    kv = llm.llm_engine.kv_cache
    kv.check_invariants()
    runner = llm.llm_engine.runner
    assert runner.host_cache.num_slots() == kv.host_cache.used <= kv.host_cache.capacity
    assert set(runner.host_cache.batches) == set(kv.host_cache.batches)


def test_a_draft_model_runs_with_the_tier_and_keeps_the_tokens():
    """Speculative decoding with a draft model: the draft recomputes its own K/V for every sequence it
    starts (its pool is indexed by the target's block ids), so blocks loaded from the tier serve the
    target alone; greedy answers as without either."""
    from tests.engine.test_spec_decode import _truncated_copy
    from tests.tiny_models import tiny_checkpoint
    draft = _truncated_copy(tiny_checkpoint("llama"), 1)
    llm = make_llm(kv_offloading_size=TIER_GIB, speculative_config={"model": draft, "num_speculative_tokens": 2})
    answers, cached = serve_turn_by_turn(llm, conversations(num=4))
    assert answers == [a for i, a in enumerate(without_tier()[0]) if i % 6 < 4]
    m = llm.get_metrics()
    assert m["jaxpaged:external_prefix_cache_hits_total"] > 0
    assert m["jaxpaged:spec_decode_num_draft_tokens_total"] > 0
    assert m["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_the_tier_computes_within_15_percent_of_a_pool_that_holds_everything():
    """Prompt tokens computed (prompt tokens less those found cached): the small pool with the tier
    against a device pool large enough for every conversation, same turns."""
    convs = conversations()
    prompt_tokens = lambda llm: llm.get_metrics()["jaxpaged:prompt_tokens_total"]
    computed = {}
    for name, kwargs in (("tier", dict(kv_offloading_size=TIER_GIB)), ("big pool", dict(num_gpu_blocks_override=400)),
                         ("small pool", {})):
        llm = make_llm(**kwargs)
        _, cached = serve_turn_by_turn(llm, convs)
        computed[name] = prompt_tokens(llm) - sum(cached)
    assert computed["tier"] <= 1.15 * computed["big pool"], computed
    assert computed["small pool"] > 1.5 * computed["big pool"], computed   # the workload needs the tier


def test_reset_prefix_cache_and_new_weights_empty_both_tiers():
    llm = make_llm(kv_offloading_size=TIER_GIB)
    serve_turn_by_turn(llm, conversations(num=3, turns=2))
    kv, runner = llm.llm_engine.kv_cache, llm.llm_engine.runner
    assert len(kv.host_cache) > 0
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)   # the next step lets the batches go
    assert len(kv.host_cache) == 0 and kv.host_cache.used == 0 and not runner.host_cache.batches
    serve_turn_by_turn(llm, conversations(num=6, turns=3, seed=8))
    assert len(kv.host_cache) > 0
    kv.reset_prefix_cache(new_weights=True)   # what a weight update or sleep level 2 does
    assert len(kv.host_cache) == 0


def test_sleep_empties_the_tier():
    llm = make_llm(kv_offloading_size=TIER_GIB, enable_sleep_mode=True)
    serve_turn_by_turn(llm, conversations(num=4, turns=2))
    kv = llm.llm_engine.kv_cache
    assert len(kv.host_cache) > 0
    llm.sleep(level=1)
    llm.wake_up()
    assert len(kv.host_cache) == 0


@pytest.mark.parametrize("kwargs,argument", [
    (dict(kv_offloading_size=-1), "kv_offloading_size"),
    (dict(kv_offloading_size=0), "kv_offloading_size"),
    (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache"), "kv_offloading_backend"),
    (dict(kv_offloading_backend="native"), "kv_offloading_backend"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "kv_offloading_size"),
    (dict(kv_offloading_size=1e-9), "kv_offloading_size"),    # less than one block
])
def test_bad_tier_arguments_are_named(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        make_llm(**kwargs)


def test_the_tier_stays_within_its_size_under_a_long_random_workload():
    """Random evictions and lookups: the slots held never pass the capacity, batches go whole, and
    every hash it reports is where it says."""
    rng = np.random.default_rng(0)
    cache = HostPrefixCache(40, padded=lambda n: 1 << max(2, (n - 1).bit_length()), max_batch=16)
    next_hash = 0
    for step in range(2000):
        evicted = []
        for _ in range(int(rng.integers(0, 20))):
            if next_hash and rng.random() < 0.3:   # a hash the tier may hold already
                evicted.append((int(rng.integers(1, 100)), int(rng.integers(0, next_hash)).to_bytes(8, "little")))
            else:
                evicted.append((int(rng.integers(1, 100)), next_hash.to_bytes(8, "little")))
                next_hash += 1
        cache.store(evicted)
        probes = [int(rng.integers(0, next_hash)).to_bytes(8, "little") for _ in range(5)] if next_hash else []
        refs = [r for r in map(cache.lookup, probes) if r is not None]
        cache.take(refs, list(range(len(refs))))
        moves = cache.take_moves()   # None: nothing stored, loaded or dropped this step
        assert moves is None or all(len(blocks) <= 16 for _, blocks in moves.stores)
        cache.check_invariants()
        assert cache.used <= 40
        if step % 500 == 499:
            cache.clear()
            assert cache.used == 0 and len(cache) == 0


@pytest.mark.parametrize("side", ["swap", "recompute"])
def test_auto_preemption_takes_the_cheaper_side_with_the_same_tokens(side):
    """preemption_mode="auto" (the default): swap when moving a request's blocks is cheaper than
    recomputing its tokens; each side forced through the measured rates, the outputs unchanged."""
    llm = make_llm(num_gpu_blocks_override=16, max_model_len=120, swap_space=0.001)
    scheduler = llm.llm_engine.scheduler
    assert llm.llm_engine.args.preemption_mode == "auto" and scheduler.cost.copy_bytes_per_s > 0
    assert scheduler.cost.block_bytes == llm.llm_engine.runner.block_bytes() > 0
    rates = {"swap": (1e12, 1.0), "recompute": (1.0, 1e12)}[side]   # (copy bytes/s, prefill tokens/s)
    observe = scheduler.cost.observe_step
    scheduler.cost.observe_step = lambda *a: None     # keep the forced rates
    scheduler.cost.copy_bytes_per_s, scheduler.cost.prefill_tokens_per_s = rates
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    m = llm.get_metrics()
    assert m["jaxpaged:num_preemptions_total"] > 0
    assert (m["jaxpaged:swapped_out_blocks_total"] > 0) == (side == "swap")
    plain = make_llm(num_gpu_blocks_override=64, max_model_len=120)
    assert tokens == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    scheduler.cost.observe_step = observe
    scheduler.cost.prefill_tokens_per_s = None
    observe(64, 0.5)
    assert scheduler.cost.prefill_tokens_per_s == 128.0   # steps computing prompts measure the rate


def test_unknown_preemption_mode_is_named():
    with pytest.raises(ValueError, match="preemption_mode.*'auto', 'recompute', 'swap'|preemption_mode.*auto"):
        make_llm(preemption_mode="fast")


def test_the_cli_and_server_flags_reach_the_engine_arguments():
    import argparse

    from jaxpaged.cli import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-offloading-size", "2.5", "--kv-offloading-backend", "native",
                                              "--preemption-mode", "auto"]))
    assert (kwargs["kv_offloading_size"], kwargs["kv_offloading_backend"], kwargs["preemption_mode"]) == (2.5, "native",
                                                                                                           "auto")
    assert engine_kwargs(parser.parse_args([]))["kv_offloading_size"] is None


def test_a_failed_load_falls_back_to_recomputing(caplog):
    """Host batches gone (lost memory, a refused transfer): the requests that hit them recompute,
    with the same tokens, and the tier forgets those batches."""
    llm = make_llm(kv_offloading_size=TIER_GIB)
    runner, kv = llm.llm_engine.runner, llm.llm_engine.kv_cache
    real_load = runner.host_cache.load

    def lose_every_batch(kv_pool, moves):
        runner.host_cache.batches.clear()
        runner.host_cache.gathered.clear()
        return real_load(kv_pool, moves)
    runner.host_cache.load = lose_every_batch
    answers, _ = serve_turn_by_turn(llm, conversations())
    assert answers == without_tier()[0]
    assert llm.get_metrics()["jaxpaged:external_prefix_cache_hits_total"] > 0   # it tried
    assert "loading batch" in caplog.text and "its requests recompute" in caplog.text
    assert set(runner.host_cache.batches) <= set(kv.host_cache.batches)   # failed batches forgotten
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0
    kv.check_invariants()
