"""Prompt embeddings (vLLM's enable_prompt_embeds, {"prompt_embeds": array}) against transformers'
`inputs_embeds` (fp32): any rows, the model's own embedding rows (which must give what the token ids
give), prefix caching keyed by the rows, chunked prefill, recompute preemption, n > 1, and clear errors."""

import functools

import numpy as np
import pytest

from jaxpaged import LLM, EngineArgs, SamplingParams
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import Request
from jaxpaged.engine.prompt_embeds import block_digests
from tests.tiny_models import hf_model, tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)


@functools.cache
def embeds_llm(arch: str = "llama") -> LLM:
    # 20 blocks of 8 tokens, 32 tokens a step: long prompts run in chunks, and four at once are preempted
    return LLM(tiny_checkpoint(arch), dtype="float32", block_size=8, num_gpu_blocks_override=20, max_model_len=128,
               max_num_seqs=4, max_num_batched_tokens=32, compile_on_startup=False, enable_prompt_embeds=True,
               preemption_mode="recompute")


def hf_rows(arch: str, token_ids: list[int]) -> np.ndarray:
    """transformers' get_input_embeddings() of the tokens: what a user feeds back as prompt_embeds (Gemma's
    includes its sqrt(hidden) scale; Granite's multiplier is applied by the forward, to any input embeddings)."""
    import torch

    with torch.no_grad():
        return hf_model(tiny_checkpoint(arch)).get_input_embeddings()(torch.tensor(token_ids)).numpy()


def assert_transformers_agrees(arch: str, embeds: np.ndarray, out) -> None:
    """Teacher-forced on our tokens: each is transformers' greedy choice (up to 1e-4) and has our logprob."""
    import torch

    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        model = hf_model(tiny_checkpoint(arch))
        rest = model.get_input_embeddings()(torch.tensor(tokens[:-1]))
        x = torch.cat([torch.tensor(embeds), rest])[None]
        logprobs = model(inputs_embeds=x).logits[0, len(embeds) - 1:].log_softmax(-1).numpy()
    for i, token in enumerate(tokens):
        assert logprobs[i, token] >= logprobs[i].max() - 1e-4, f"step {i}: {token} is not transformers' choice"
        assert abs(out.outputs[0].logprobs[i][token].logprob - logprobs[i, token]) < 1e-3


@pytest.mark.parametrize("arch", ["llama", "gemma", "granite", "gpt2"])
def test_embeddings_run_as_transformers_runs_them(arch):
    """Any rows run as transformers' inputs_embeds; the model's own rows give exactly the tokens' output
    (Gemma scales its lookup, Granite every input embedding, GPT-2 adds its positions after)."""
    llm = embeds_llm(arch)
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 300, 21).tolist()
    free = rng.normal(0.0, 0.5, (13, llm.llm_engine.model_config.hidden_size)).astype(np.float32)
    outs = llm.generate([{"prompt_embeds": free}, {"prompt_token_ids": ids}, {"prompt_embeds": hf_rows(arch, ids)}],
                        GREEDY, use_tqdm=False)
    assert_transformers_agrees(arch, free, outs[0])
    assert outs[2].outputs[0].token_ids == outs[1].outputs[0].token_ids
    ours = [lp[t].logprob for lp, t in zip(outs[2].outputs[0].logprobs, outs[2].outputs[0].token_ids)]
    tokens = [lp[t].logprob for lp, t in zip(outs[1].outputs[0].logprobs, outs[1].outputs[0].token_ids)]
    np.testing.assert_allclose(ours, tokens, atol=1e-5)
    assert outs[0].prompt_token_ids is None and outs[0].num_prompt_tokens == 13 and outs[0].prompt is None
    assert outs[1].num_prompt_tokens == 21


def test_the_prefix_cache_shares_blocks_of_equal_rows_only():
    llm = embeds_llm()
    rng = np.random.default_rng(11)
    rows = rng.normal(0.0, 0.5, (21, llm.llm_engine.model_config.hidden_size)).astype(np.float32)
    first = llm.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": rows.copy()}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16   # two full blocks of 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    late, early = rows.copy(), rows.copy()
    late[18] += 1.0    # in the third block: the first two are shared
    early[3] += 1.0    # in the first: nothing is
    outs = llm.generate([{"prompt_embeds": late}, {"prompt_embeds": early}], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [16, 0]
    assert_transformers_agrees("llama", late, outs[0])
    # a prompt of token 0s (the placeholders' ids) never finds an embeddings prompt's blocks, nor they its
    zeros = llm.generate({"prompt_token_ids": [0] * 21}, GREEDY, use_tqdm=False)[0]
    assert zeros.num_cached_tokens == 0
    salted = llm.generate({"prompt_embeds": rows, "cache_salt": "other"}, GREEDY, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0


def test_long_prompts_in_chunks_preempted_and_recomputed_give_the_tokens_output():
    """Four 40-row prompts through a 32-token step budget and a pool too small for them all: chunked,
    preempted, recomputed from their rows, and still what the same prompts as token ids give."""
    llm = embeds_llm()
    engine = llm.llm_engine
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, 40).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = engine.metrics.num_preemptions_total
    by_rows = llm.generate([{"prompt_embeds": hf_rows("llama", p)} for p in prompts], params, use_tqdm=False)
    assert engine.metrics.num_preemptions_total > before
    by_ids = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_rows] == [o.outputs[0].token_ids for o in by_ids]
    assert engine.kv_cache.pool.num_free_blocks() == engine.kv_cache.pool.num_usable_blocks


def test_a_prompts_last_row_left_alone_is_still_its_row():
    """Two short prompts decode beside a 53-row one: its chunks (22 tokens, then 30) leave its last row
    alone in a step, as a decode would be; it is still read from the rows, not from its placeholder id."""
    llm = embeds_llm()
    rng = np.random.default_rng(9)
    short = [rng.integers(3, 300, 5).tolist() for _ in range(2)]
    long = rng.integers(3, 300, 53).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 2 + [GREEDY]
    by_rows = llm.generate([{"prompt_token_ids": p} for p in short] + [{"prompt_embeds": hf_rows("llama", long)}],
                           params, use_tqdm=False)
    by_ids = llm.generate({"prompt_token_ids": long}, GREEDY, use_tqdm=False)[0]
    assert by_rows[2].outputs[0].token_ids == by_ids.outputs[0].token_ids


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`")   # what it checks
def test_repetition_penalty_reads_the_output_only_as_in_transformers():
    """A prompt of embeddings has no tokens to penalise: transformers' generate(inputs_embeds=...) penalises
    the generated ones only, and so does the engine (its placeholder ids, 0s, are not the prompt's tokens)."""
    import torch

    llm = embeds_llm()
    model = hf_model(tiny_checkpoint("llama"))
    rows = hf_rows("llama", [5, 80, 7, 41, 41, 9, 120, 33, 6, 250, 17])
    params = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.8, ignore_eos=True)
    ours = llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = model.generate(inputs_embeds=torch.tensor(rows)[None],
                             attention_mask=torch.ones(1, len(rows), dtype=torch.long), max_new_tokens=12,
                             min_new_tokens=12, do_sample=False, repetition_penalty=1.8, pad_token_id=0)
        logits = model(inputs_embeds=torch.tensor(rows)[None]).logits[0, -1].numpy()
    assert ours == ref[0].tolist()
    # token 0 lifted just past the best one by a bias: unpenalised it wins, as it would not if 0 were a prompt token
    best = float(np.max(np.delete(logits, 0)))
    assert abs(logits[0]) > 1.0   # the penalty moves it by more than the 0.2 margin
    lifted = SamplingParams(temperature=0.0, max_tokens=1, repetition_penalty=1.8,
                            logit_bias={0: best - float(logits[0]) + 0.2})
    assert llm.generate({"prompt_embeds": rows}, lifted, use_tqdm=False)[0].outputs[0].token_ids == [0]


def test_n_samples_fork_off_an_embeddings_prompt():
    llm = embeds_llm()
    ids = list(range(10, 30))
    rows = hf_rows("llama", ids)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    by_rows = llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)[0]
    by_ids = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in by_rows.outputs] == [c.token_ids for c in by_ids.outputs]
    assert len({tuple(c.token_ids) for c in by_rows.outputs}) > 1


def test_bad_embeddings_are_value_errors_and_leave_nothing_behind():
    llm = embeds_llm()
    engine = llm.llm_engine
    hidden = engine.model_config.hidden_size
    good = np.zeros((4, hidden), np.float32)
    cases = [({"prompt_embeds": np.zeros((4, hidden + 1))}, GREEDY, "hidden_size"),
             ({"prompt_embeds": np.zeros(hidden)}, GREEDY, "shape"),
             ({"prompt_embeds": np.zeros((0, hidden))}, GREEDY, "at least 1 row"),
             ({"prompt_embeds": np.full((2, hidden), np.nan)}, GREEDY, "finite"),
             ({"prompt_embeds": np.array([["a"] * hidden])}, GREEDY, "numbers"),
             ({"prompt_embeds": good, "prompt_token_ids": [1, 2]}, GREEDY, "not both"),
             ({"prompt_embeds": good}, SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
             ({"prompt_embeds": np.zeros((200, hidden))}, GREEDY, "max_model_len")]
    for prompt, params, words in cases:
        with pytest.raises(ValueError, match=words):
            llm.generate(prompt, params, use_tqdm=False)
    with pytest.raises(ValueError, match="generation only"):
        llm.beam_search([{"prompt_embeds": good}], __import__("jaxpaged").BeamSearchParams(beam_width=2, max_tokens=2))
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.pool.num_free_blocks() == engine.kv_cache.pool.num_usable_blocks
    # truncate_prompt_tokens keeps the last rows, as it keeps the last tokens
    rows = hf_rows("llama", list(range(40, 60)))
    cut = llm.generate({"prompt_embeds": rows}, SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    ids = llm.generate({"prompt_token_ids": list(range(55, 60))}, SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)[0]
    assert cut.num_prompt_tokens == 5 and cut.outputs[0].token_ids == ids.outputs[0].token_ids


def test_embeddings_need_the_flag_and_a_plain_generating_engine():
    plain = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=16,
                max_model_len=64, compile_on_startup=False)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        plain.generate({"prompt_embeds": np.zeros((3, plain.llm_engine.model_config.hidden_size))}, use_tqdm=False)
    for kwargs, name in (({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
                         ({"runner": "pooling"}, "runner"),
                         ({"num_nodes": 2, "distributed_coordinator": "h:1"}, "num_nodes")):
        with pytest.raises(ValueError, match=f"enable_prompt_embeds must be False with {name}"):
            EngineArgs(enable_prompt_embeds=True, **kwargs)


def test_block_hashes_and_routing_count_the_rows():
    """A data-parallel router finds the replica holding a prompt of embeddings' blocks by their rows."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    digests = block_digests(rows, 4)
    assert len(digests) == 3   # two full blocks and the last two rows
    request = Request("a", [0] * 10, SamplingParams(max_tokens=1), (), None, 0, 1, prompt_embeds=rows,
                      prompt_embeds_digests=digests)
    kv.allocate_slots(request, 10)
    kv._cache_full_blocks(request, 10)
    assert kv.cached_prefix_tokens([0] * 10, None, digests) == 8
    other = rows.copy()
    other[5] = -1
    assert kv.cached_prefix_tokens([0] * 10, None, block_digests(other, 4)) == 4
    assert kv.cached_prefix_tokens([0] * 10) == 0   # token 0s: another prompt

    from jaxpaged.engine.dp_engine import DataParallelEngine
    from jaxpaged.engine.input_processor import EmbedsSpec, InputProcessor

    class Replica:
        def __init__(self, rank, kv_cache):
            self.data_rank, self.kv_cache, self.added = rank, kv_cache, []
            self.input_processor = InputProcessor(None, 1000, 64, 5, lambda n: None,
                                                  embeds=EmbedsSpec(4, np.float32, 4))

        def get_num_unfinished_requests(self):
            return 0

        def add_request(self, *args):
            self.added.append(args)

    dp = object.__new__(DataParallelEngine)
    dp.engines = [Replica(0, KVCacheManager(num_blocks=16, block_size=4)), Replica(1, kv)]
    dp._owner, dp._ids = {}, iter(range(9))
    dp.add_request("x", {"prompt_embeds": rows.tolist()}, SamplingParams(max_tokens=1))
    assert not dp.engines[0].added and len(dp.engines[1].added) == 1
    forwarded = dp.engines[1].added[0][1]["prompt_embeds"]
    np.testing.assert_array_equal(forwarded, rows)
