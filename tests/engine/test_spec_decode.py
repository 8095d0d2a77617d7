"""Speculative decoding changes how many steps a request takes, never what it gets: greedy fp32
tokens are identical with every memory feature, sampled tokens keep their distribution, seeds
reproduce, and bad configurations are refused by name."""

import dataclasses

import jax
import numpy as np
import pytest
from scipy import stats

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.spec_decode import SpeculativeConfig, ngram_proposal
from jaxpaged.runner.step_input import emitted_rows
from jaxpaged.runner.sampler import sample
from tests.engine.test_memory_features import make_llm, workload
from tests.fixtures_smollm2 import BUILTIN_LEVEL, QUICKSTART_SHAPE
from tests.runner.test_sampler import metadata, params, softmax
from tests.tiny_models import scratch_folder

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _truths(llm, prompts, sampling):
    """The engine's outputs without speculation, by request index (LLM ids are 'gen-<index>'...)."""
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    return [p["prompt_token_ids"] + o.outputs[0].token_ids for p, o in zip(prompts, outs)], outs


def oracle(truths, error_rate: float, seed: int = 0):
    """A proposer that knows each request's greedy continuation and gets a share of its tokens wrong,
    so verification both accepts and rejects (prompt lookup rarely fires on random checkpoints)."""
    rng = np.random.default_rng(seed)

    def propose(request, k):
        full = truths[int(request.request_id.split("#")[0].rsplit("-", 1)[-1])]   # a fresh LLM's i-th: gen-i
        drafts = list(full[request.num_tokens:request.num_tokens + k])
        return [int(rng.integers(3, 320)) if rng.random() < error_rate else t for t in drafts]

    return propose


@pytest.fixture(scope="module")
def plain():
    prompts, sampling = workload()
    llm = make_llm(enable_prefix_caching=False, enable_chunked_prefill=False)
    truths, outs = _truths(llm, prompts, sampling)
    return truths, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("opts", [
    dict(),
    dict(enable_prefix_caching=True, max_num_batched_tokens=32),            # prefix hits, chunked prefill
    dict(num_gpu_blocks_override=16, max_model_len=120, preemption_mode="swap", swap_space=0.001,
         enable_prefix_caching=False),
    dict(num_gpu_blocks_override=16, max_model_len=120, preemption_mode="recompute", enable_prefix_caching=False),
], ids=["default", "prefix-chunked", "swap", "recompute"])
def test_greedy_outputs_are_identical_with_every_memory_feature(plain, opts):
    truths, expected = plain
    llm = make_llm(speculative_config=NGRAM, **opts)
    llm.llm_engine.speculator.proposer = oracle(truths, error_rate=0.2)
    prompts, sampling = workload()
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    m = llm.get_metrics()
    assert m["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"
    accepted = m["jaxpaged:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < m["jaxpaged:spec_decode_num_draft_tokens_total"], "both accepts and rejects"
    per_pos = [m[f'jaxpaged:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}'] for j in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    if opts.get("preemption_mode"):
        assert m["jaxpaged:num_preemptions_total"] > 0
    if opts.get("enable_prefix_caching"):
        assert m["jaxpaged:prefix_cache_hits_total"] > 0


def test_ngram_proposal_takes_the_longest_most_recent_match():
    tokens = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert ngram_proposal(tokens, 3, 1, 4) == [9, 2, 6]            # "6 7" last followed by 9
    assert ngram_proposal(np.array([1, 2, 3, 4]), 3, 1, 4) == []   # nothing repeats
    assert ngram_proposal(np.array([4, 1, 2, 3, 1, 2]), 2, 2, 2) == [3, 1]


def test_rejection_sampler_keeps_the_distribution_for_any_draft():
    """One row's distribution p, verified against drafts of every kind: the kept-or-recovered token
    must be distributed as p (chi-square over 4096 seeded rows per draft)."""
    V = 16
    logits = np.random.default_rng(4).normal(size=V).astype(np.float32) * 1.5
    p = softmax(logits)
    rows = 4096
    md = metadata([params(temperature=1.0)] * rows, rows, seeds=list(range(rows)))
    critical = stats.chi2.ppf(1 - 1e-6, df=V - 1)
    run = jax.jit(sample)
    for draft in (int(np.argmax(p)), int(np.argmin(p)), 7):
        out = run(np.tile(logits, (rows, 1)), dataclasses.replace(md, draft_tokens=np.full(rows, draft, np.int32)))
        tokens, accepted = np.asarray(out.token_ids), np.asarray(out.accepted)
        counts = np.bincount(tokens, minlength=V)
        assert np.sum((counts - p * rows) ** 2 / (p * rows)) < critical
        assert np.all(tokens[accepted] == draft) and abs(accepted.mean() - p[draft]) < 0.03
    # greedy rows accept exactly the argmax
    greedy = metadata([params(temperature=0.0)] * 2, 2)
    out = run(np.tile(logits, (2, 1)), dataclasses.replace(greedy, draft_tokens=np.array([np.argmax(p), 3], np.int32)))
    assert np.asarray(out.accepted).tolist() == [True, False]
    assert np.asarray(out.token_ids).tolist() == [np.argmax(p)] * 2


def test_a_sequence_keeps_its_rows_up_to_the_first_rejection():
    #        seq A: rows 0-3 (drafts at 0-2)   seq B: row 4 (no draft)   seq C: rows 5-6
    drafts = np.array([9, 9, 9, -1, -1, 9, -1])
    accepted = np.array([True, False, True, False, False, False, False])
    first = np.array([0, 0, 0, 0, 4, 5, 5])
    assert np.asarray(emitted_rows(drafts, accepted, first)).tolist() == [True, True, False, False, True, True, False]


def test_sampled_tokens_are_those_of_the_same_seed_without_speculation(plain):
    """temperature 1.0 with top-k and top-p: a verified row accepts its draft when it draws it, so
    every seeded request gets exactly its tokens without speculation, however many of its positions
    were verified (the distribution itself is the sampler test's, above), in any batch."""
    truths, _ = plain
    prompts, _ = workload()
    prompt = prompts[1]
    sampling = SamplingParams(temperature=1.0, top_k=2, top_p=0.95, max_tokens=6, ignore_eos=True, n=32, seed=3)
    base, spec = make_llm(max_num_seqs=64), make_llm(max_num_seqs=64, speculative_config=NGRAM)
    greedy = truths[1]
    spec.llm_engine.speculator.proposer = lambda request, k: list(greedy[request.num_tokens:request.num_tokens + k])

    def tokens(llm, batch):
        outs = llm.generate(batch, sampling, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]

    want = tokens(base, [prompt])
    assert tokens(spec, [prompt]) == want
    assert tokens(spec, [prompts[2], prompt, prompts[3]])[1] == want[0]   # other requests beside it
    m = spec.get_metrics()
    assert 0 < m["jaxpaged:spec_decode_num_accepted_tokens_total"] < m["jaxpaged:spec_decode_num_draft_tokens_total"]


@pytest.mark.parametrize("config, name", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"speculative_tokens": 3}, "unknown key"),
    ({"method": "draft_model"}, "model"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_key(config, name):
    with pytest.raises(ValueError, match=name):
        SpeculativeConfig.parse(config)
    with pytest.raises(ValueError, match=name):
        LLM(None, speculative_config=config)   # refused before anything loads


def test_beam_search_with_speculation_is_refused():
    from jaxpaged.sampling_params import BeamSearchParams

    llm = make_llm(speculative_config=NGRAM)
    with pytest.raises(ValueError, match="speculative_config"):
        llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=4))


def test_builtin_model_prompt_lookup_keeps_greedy_outputs_and_stop_strings():
    """The built-in model asked to repeat passages: prompt lookup is accepted most of the time, and
    the outputs (tokens and text, with a stop string and n = 2) are those without speculation."""
    from jaxpaged.benchmarks.throughput import make_repeat_workload

    # the quickstart notebook's CPU engine shape (the run's compilation cache shares its steps)
    opts = dict(**QUICKSTART_SHAPE, compile_on_startup=False,
                optimization_level=BUILTIN_LEVEL, use_tqdm=False)
    base = LLM(None, **opts)
    work = make_repeat_workload(3, base.get_tokenizer(), seed=1)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    sampling = [SamplingParams(temperature=0.0, max_tokens=min(work[0][1], 40)),   # 40 of its 80: enough repeats
                SamplingParams(temperature=0.0, max_tokens=work[1][1], stop=[" the "]),
                SamplingParams(temperature=0.0, max_tokens=24, n=2)]

    def summary(llm):
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                for o in llm.generate(prompts, sampling, use_tqdm=False)]

    # a stop string at the 6th token of a request whose max_tokens stops it 3 tokens later: with
    # several tokens kept per step the stop lands inside a step (stop, not length, and no more tokens)
    tokenizer = base.get_tokenizer()
    first = base.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    ids = first.outputs[0].token_ids
    piece = next(tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(5, 12)
                 if len(tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):].strip()) >= 3)
    prompts.append(prompts[0])
    sampling.append(SamplingParams(temperature=0.0, max_tokens=12, stop=[piece]))
    expected = summary(base)
    del base
    assert expected[1][0][3] == " the " and expected[3][0][2:] == ("stop", piece)
    spec = LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **opts)
    assert summary(spec) == expected
    m = spec.get_metrics()
    assert m["jaxpaged:spec_decode_num_accepted_tokens_total"] > 0.6 * m["jaxpaged:spec_decode_num_draft_tokens_total"]
    del spec
    # the built-in model as its own draft: every greedy draft is accepted
    from jaxpaged.models.builtin import builtin_model_path
    own = LLM(None, speculative_config={"model": builtin_model_path(), "num_speculative_tokens": 3}, **opts)
    assert summary(own) == expected
    m = own.get_metrics()
    assert m["jaxpaged:spec_decode_num_accepted_tokens_total"] == m["jaxpaged:spec_decode_num_draft_tokens_total"] > 0


def _truncated_copy(path: str, num_layers: int) -> str:
    """The checkpoint at `path` with only its first `num_layers` layers (a draft model)."""
    import os

    import transformers

    out = os.path.join(scratch_folder("draft-"), "draft")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("opts", [dict(), dict(num_gpu_blocks_override=24, enable_prefix_caching=False)],
                         ids=["default", "recompute"])
def test_draft_model_keeps_greedy_outputs(plain, opts):
    """A one-layer copy of the target as its draft: some drafts accepted, outputs unchanged (also
    when preemption recomputes a request, whose draft K/V are then recomputed too)."""
    _, expected = plain
    from tests.tiny_models import tiny_checkpoint

    draft = _truncated_copy(tiny_checkpoint("llama"), 1)
    llm = make_llm(speculative_config={"model": draft, "num_speculative_tokens": 3}, **opts)
    prompts, sampling = workload()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)] == expected
    m = llm.get_metrics()
    assert m["jaxpaged:spec_decode_num_draft_tokens_total"] > 0
    assert m["jaxpaged:kv_cache_usage_perc"] == 0.0
    if opts:
        assert m["jaxpaged:num_preemptions_total"] > 0


def test_draft_model_with_another_vocabulary_is_refused():
    from tests.tiny_models import tiny_checkpoint

    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(speculative_config={"model": tiny_checkpoint("llama", vocab_size=256), "num_speculative_tokens": 2})


def test_serve_and_generate_take_speculative_config_json():
    import argparse

    from jaxpaged import cli
    from jaxpaged.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    args = EngineArgs(**cli.engine_kwargs(ns))
    assert SpeculativeConfig.parse(args.speculative_config) == SpeculativeConfig("ngram", 2)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(**cli.engine_kwargs(parser.parse_args(["--speculative-config", "[1]"])))


def test_requests_whose_drafts_miss_back_off_together():
    """A request proposed for and rejected waits at least 2, 4, 8, then 16 steps, until a multiple of
    that period (so backed-off requests come due in the same steps); an accepted draft resets it."""
    from jaxpaged.core.request import Request
    from jaxpaged.engine.spec_decode import MAX_BACKOFF, Speculator

    spec = Speculator(SpeculativeConfig("ngram", 2), max_model_len=10_000)
    spec.proposer = lambda request, k: [7] * k
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=5000)) for i in range(3)]
    for r in requests:
        r.append_output_token(4)
        r.num_computed_tokens = r.num_tokens - 1
    proposed_at = []
    for step in range(80):
        if spec.wants_tokens(requests):
            spec.propose(requests)
            drafted = [r for r in requests if r.spec_token_ids]
            if drafted:
                proposed_at.append(step)
            for r in drafted:
                r.spec_token_ids = []
                spec.observe(r.request_id, 2, 0)
        spec.end_step()
    gaps = np.diff(proposed_at)
    assert gaps.tolist()[:3] == [2, 6, 8] and set(gaps[3:]) == {2 ** MAX_BACKOFF}
    spec.observe("r0", 2, 1)   # accepted: proposed again at the next step
    assert spec.wants_tokens(requests[:1])
    assert spec.metrics()["spec_decode_num_drafts_total"] == 3 * len(proposed_at) + 1


def test_drafts_that_always_miss_leave_most_steps_unverified():
    """Every proposal rejected: requests back off, so few steps verify (the rest run as without
    speculation, asynchronously) and the outputs are unchanged."""
    llm = make_llm(speculative_config=NGRAM)
    llm.llm_engine.speculator.proposer = lambda request, k: [(request.all_token_ids[-1] + 1) % 320] * k
    prompts, _ = workload()
    sampling = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    base = make_llm(enable_prefix_caching=False, enable_chunked_prefill=False)
    want = [o.outputs[0].token_ids for o in base.generate(prompts[:4], sampling, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:4], sampling, use_tqdm=False)] == want
    m = llm.get_metrics()
    assert 0 < m["jaxpaged:spec_decode_num_drafts_total"] <= 0.15 * 4 * 60
