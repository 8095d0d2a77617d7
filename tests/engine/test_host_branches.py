"""On a GPU the host picks the step's branches (model_runner.HOST_BRANCH_PLATFORMS): the forward returns
its hidden states and prompt logprobs run as a third executable only for steps that ask, and the
sampler is compiled in three kinds (plain greedy; branch-free without top-k/top-p; general), chosen
per step by the host (XLA:GPU reads a `lax.cond`'s predicate on the host, which kept the host from
running ahead of the device). Forced here on the CPU: the same outputs as the conditionals' engine,
and nothing compiles after start-up."""

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.runner import model_runner
from tests.engine.test_no_compiles_after_startup import compilations
from tests.tiny_models import tiny_checkpoint

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6),
    SamplingParams(temperature=0.8, seed=1, max_tokens=7, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
    SamplingParams(presence_penalty=0.5, repetition_penalty=1.2, temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.0, logit_bias={7: 5.0}, min_tokens=3, max_tokens=6, logprobs=1),
    SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=5),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2, max_tokens=6, prompt_logprobs=1),
]


def run(monkeypatch, host_branches: bool):
    if host_branches:
        monkeypatch.setattr(model_runner, "HOST_BRANCH_PLATFORMS", ("cpu", "gpu"))
    # a budget of 6 tokens: a prompt given one token of it lands in a decode-shaped step of 8 sequences
    # (below), a token count no prompt bucket has
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, max_model_len=64, max_num_seqs=8,
              max_num_batched_tokens=6, use_tqdm=False)
    runner = llm.llm_engine.runner
    assert runner.host_branches == host_branches
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 320, n).tolist()} for n in (3, 20, 9, 40, 5, 12, 27)]
    shapes, choose = [], model_runner.shape_for
    monkeypatch.setattr(model_runner, "shape_for", lambda *a, **k: shapes.append(choose(*a, **k)) or shapes[-1])
    picked = []
    if host_branches:
        sample = runner.sample

        def recording(pending):
            picked.append(pending.inputs.sampler_kind)
            return sample(pending)
        monkeypatch.setattr(runner, "sample", recording)
    with compilations() as compiled:
        outs = llm.generate([{"prompt_token_ids": [3 + i]} for i in range(5)] + [prompts[3]],
                            [SamplingParams(temperature=0.0, max_tokens=3)] * 5
                            + [SamplingParams(max_tokens=2, prompt_logprobs=2)], use_tqdm=False)
        assert shapes[0].q_tile == 1 and shapes[0].num_tokens == 8, shapes[0]
        assert len(outs[-1].prompt_logprobs) == 40
        outs += llm.generate(prompts, PARAMS, use_tqdm=False)
        outs += llm.generate(prompts[:5], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        outs += llm.generate(prompts[:4], [SamplingParams(temperature=0.7, seed=9 + i, presence_penalty=0.3 * i,
                                                          logit_bias={5: 2.0} if i == 2 else None, min_p=0.05,
                                                          logprobs=2, max_tokens=5) for i in range(4)],
                             use_tqdm=False)
    assert compiled == [], f"compiled after start-up: {compiled}"
    return outs, picked, runner


def flatten(outs):
    tokens, logprobs = [], []
    for o in outs:
        prompt = [lp for step in (o.prompt_logprobs or []) if step for lp in sorted(
            (t, x.logprob) for t, x in step.items())]
        logprobs.append(prompt)
        for c in o.outputs:
            tokens.append(list(c.token_ids))
            logprobs.append([(t, x.logprob) for step in (c.logprobs or []) for t, x in sorted(step.items())])
    return tokens, logprobs


def test_host_picked_branches_give_the_conditionals_outputs_and_compile_nothing_after_start_up(monkeypatch):
    expected, _, _ = run(monkeypatch, host_branches=False)
    got, picked, runner = run(monkeypatch, host_branches=True)
    assert set(picked) == {"greedy", "untruncated", "general"}, "every sampler kind ran"
    assert runner._prompt_fns, "prompt logprobs ran as their own executable"
    (want_tokens, want_lps), (got_tokens, got_lps) = flatten(expected), flatten(got)
    assert got_tokens == want_tokens
    assert len(got_lps) == len(want_lps)
    for a, b in zip(got_lps, want_lps):
        assert [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([x for _, x in a], [x for _, x in b], rtol=0, atol=1e-5)



def test_every_request_mix_and_speculation_compile_nothing_after_start_up_with_host_branches(monkeypatch):
    """The start-up checks of test_no_compiles_after_startup.py with the host picking branches: beam
    search, structured outputs (a held-back sampler), swap and recompute, n > 1, and a draft model's
    runner beside the target's, which compiles the greedy sampler alone and no prompt-logprobs programs
    (its requests are always plain greedy)."""
    from tests.engine import test_no_compiles_after_startup as startup

    monkeypatch.setattr(model_runner, "HOST_BRANCH_PLATFORMS", ("cpu", "gpu"))
    kinds, pick = [], model_runner.sampler_kind
    monkeypatch.setattr(model_runner, "sampler_kind", lambda requests: kinds.append(pick(requests)) or kinds[-1])
    startup.test_no_request_mix_compiles_after_startup(monkeypatch)
    llm = startup.speculative_run()
    assert set(kinds) == {"greedy", "untruncated", "general"}
    target, draft = llm.llm_engine.runner, llm.llm_engine.speculator.drafter.runner
    assert {key[2] for key in target._samplers} == {"greedy", "untruncated", "general"} and target._prompt_fns
    assert {key[2] for key in draft._samplers} == {"greedy"} and not draft._prompt_fns
    assert {key[0] for key in draft._samplers} == {shape.num_logits for shape in draft.warmup_shapes()}
