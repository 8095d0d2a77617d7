"""Custom logits processors (vLLM's `logits_processors`, jaxpaged.LogitsProcessor): claimed requests get the
processors' logits, the others exactly the tokens and logprobs of an engine without them, through slot reuse,
n > 1, async scheduling and random sampling, with nothing compiled after start-up; bad arguments are
ValueErrors naming them."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import EngineArgs, LLM, LogitsProcessor, SamplingParams
from tests.engine.test_no_compiles_after_startup import compilations
from tests.tiny_models import tiny_checkpoint

PROMPTS = [[5, 17, 42, 9], [100, 250, 31], [7, 7, 8, 9, 10, 11], [64, 3], [200, 201, 202, 203, 204], [40, 41]]


def _token_arg(params, key):
    value = (params.extra_args or {}).get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"extra_args.{key} must be a token id (an int >= 0), got {value!r}")
    return value


class ForceToken(LogitsProcessor):
    """vLLM's example processor: a request with extra_args {"target_token": t} samples t alone."""

    def __init__(self, config):
        super().__init__(config)
        self.targets = np.full(config.num_slots, -1, np.int32)   # per slot; -1: not claimed

    @classmethod
    def validate_params(cls, params):
        _token_arg(params, "target_token")

    def add_request(self, slot, params):
        target = _token_arg(params, "target_token")
        self.targets[slot] = -1 if target is None else target
        return target is not None

    def state(self):
        return self.targets

    def apply(self, logits, ctx, targets):
        allowed = jnp.arange(logits.shape[1])[None, :] == targets[ctx.slots][:, None]
        return jnp.where(allowed, logits, -jnp.inf)


class ForceAt(LogitsProcessor):
    """extra_args {"force_at": k, "token": t}: the k-th generated token is t (reads ctx.num_output_tokens)."""

    def __init__(self, config):
        super().__init__(config)
        self.at = np.full((config.num_slots, 2), -1, np.int32)

    def add_request(self, slot, params):
        args = params.extra_args or {}
        self.at[slot] = (args.get("force_at", -1), args.get("token", -1))
        return "force_at" in args

    def state(self):
        return self.at

    def apply(self, logits, ctx, at):
        k, token = at[ctx.slots, 0], at[ctx.slots, 1]
        forced = jnp.arange(logits.shape[1])[None, :] == token[:, None]
        return jnp.where((ctx.num_output_tokens == k)[:, None], jnp.where(forced, 0.0, -jnp.inf), logits)


class AddBias(LogitsProcessor):
    """extra_args {"bias": {token: value}}: logit_bias, as a processor (a [num_slots, V] state)."""

    def __init__(self, config):
        super().__init__(config)
        self.bias = np.zeros((config.num_slots, config.vocab_size), np.float32)

    def add_request(self, slot, params):
        self.bias[slot] = 0.0
        for token, value in (params.extra_args or {}).get("bias", {}).items():
            self.bias[slot, token] = value
        return "bias" in (params.extra_args or {})

    def state(self):
        return self.bias

    def apply(self, logits, ctx, bias):
        return logits + bias[ctx.slots]


class NoRepeatNGram(LogitsProcessor):
    """extra_args {"no_repeat_ngram_size": n} (n <= 4): a token completing an n-gram the output already holds is
    banned (vLLM's builtin of that name: the output only). Reads the slots' output tokens (ctx.output_tokens)."""
    MAX_N = 4

    def __init__(self, config):
        super().__init__(config)
        self.sizes = np.zeros(config.num_slots, np.int32)

    def add_request(self, slot, params):
        self.sizes[slot] = (params.extra_args or {}).get("no_repeat_ngram_size", 0)
        return bool(self.sizes[slot])

    def state(self):
        return self.sizes

    def apply(self, logits, ctx, sizes):
        n, length = sizes[ctx.slots][:, None], ctx.num_output_tokens[:, None]   # [S, 1]
        history = ctx.output_tokens[ctx.slots]                                   # [S, H]
        H = history.shape[1]
        starts = jnp.arange(H)[None, :]
        at = lambda index: jnp.take_along_axis(history, jnp.clip(index, 0, H - 1), axis=1)  # noqa: E731
        match = (starts <= length - n) & (n > 0)
        for offset in range(self.MAX_N - 1):   # the n-gram's first n - 1 tokens against the output's last
            match &= (offset >= n - 1) | (at(starts + offset) == at(length - n + 1 + offset))
        banned = jnp.where(match, at(starts + n - 1), logits.shape[1])   # out of bounds: dropped
        return logits.at[jnp.arange(logits.shape[0])[:, None], banned].set(-jnp.inf, mode="drop")


def _llm(**kwargs):
    return LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=96, max_model_len=64,
               max_num_seqs=2, max_num_batched_tokens=32, use_tqdm=False, **kwargs)


def _params():
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    random = dict(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=2)
    return [SamplingParams(**greedy),
            SamplingParams(**greedy, extra_args={"target_token": 7}),
            SamplingParams(**random, seed=3),
            SamplingParams(**random, seed=4, extra_args={"target_token": 11}),
            SamplingParams(**greedy, extra_args={"force_at": 3, "token": 5}),
            SamplingParams(**random, n=2, seed=5, extra_args={"target_token": 13, "unused": [1, "a"]})]


def _outs(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    return [[(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in o.outputs]
            for o in outs]


def test_claimed_requests_get_the_processors_logits_and_the_others_their_own():
    """Six requests through two slots (each slot reused by claimed and unclaimed requests), processors given as
    a class and as 'module:Class', compiled at start-up: nothing compiles while they run."""
    plain = _outs(_llm(compile_on_startup=False))
    llm = _llm(logits_processors=[ForceToken, "tests.engine.test_logits_processors:ForceAt"])
    with compilations() as compiled:
        got = _outs(llm)
    assert compiled == [], f"compiled after start-up: {compiled}"
    for i in (0, 2):   # not claimed, greedy and seeded random: the very tokens and logprobs
        (tokens, logprobs), = got[i]
        (want_tokens, want_logprobs), = plain[i]
        assert tokens == want_tokens
        np.testing.assert_allclose([lp[t] for t, lp in zip(tokens, logprobs)],
                                   [lp[t] for t, lp in zip(want_tokens, want_logprobs)], rtol=1e-5, atol=1e-5)
    assert got[1][0][0] == [7] * 8 and got[3][0][0] == [11] * 8
    assert [c[0] for c in got[5]] == [[13] * 8, [13] * 8]   # n = 2: both siblings claimed
    forced, want = got[4][0][0], plain[4][0][0]
    assert forced[:3] == want[:3] and forced[3] == 5 and want[3] != 5
    # raw logprobs (the default logprobs_mode): the forced token's logprob under the model itself
    assert got[1][0][1][0][7] < 0


def test_a_processor_adding_a_bias_draws_the_tokens_of_logit_bias():
    """Random rows keep their distribution: a processor adding logit_bias's values (after bias and penalties, before
    temperature and top-p) draws, with the same seeds, the very tokens logit_bias does."""
    bias = {3: 4.0, 9: 2.5, 40: 3.0, 41: -100.0}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]

    def params(**kw):
        return [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=12, ignore_eos=True, **kw)
                for s in range(4)]
    want = _llm(compile_on_startup=False).generate(prompts, params(logit_bias=bias), use_tqdm=False)
    got = _llm(compile_on_startup=False, logits_processors=[AddBias]).generate(
        prompts, params(extra_args={"bias": bias}), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(t in bias for o in got for t in o.outputs[0].token_ids) > 12   # the bias shows


@pytest.mark.parametrize("host_branches", [False, True])
def test_bad_arguments_are_value_errors_and_a_claimed_plain_greedy_request_is_processed(monkeypatch, host_branches):
    """A greedy request without logprobs, alone: its sampler is not the plain-greedy one (which runs no processor),
    whether the device picks it (lax.cond, a CPU's) or the host (host_branches, a GPU's)."""
    if host_branches:
        from jaxpaged.runner import model_runner
        monkeypatch.setattr(model_runner, "HOST_BRANCH_PLATFORMS", ("cpu", "gpu"))
    llm = _llm(compile_on_startup=False, logits_processors=[ForceToken])
    assert llm.llm_engine.runner.host_branches == host_branches
    for bad in ("7", -1, True):
        with pytest.raises(ValueError, match=r"extra_args\.target_token must be a token id"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(extra_args={"target_token": bad}),
                         use_tqdm=False)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=3, extra_args={"target_token": 9}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [9, 9, 9]
    pool = llm.llm_engine.kv_cache.pool
    assert pool.num_free_blocks() == pool.num_usable_blocks   # the refused requests took no block
    with pytest.raises(ValueError, match="extra_args must be None or a dict with string keys"):
        SamplingParams(extra_args=[("target_token", 1)])


class NoApply(LogitsProcessor):
    """A processor that forgot its apply."""


@pytest.mark.parametrize("spec, message", [
    (NoApply, r"logits_processors\[0\]: NoApply must define apply"),
    ("tests.engine.test_logits_processors.ForceToken", r"logits_processors\[0\] must be .*'module:Class'"),
    ("tests.engine.no_such_module:ForceToken", r"logits_processors\[0\]: cannot load"),
    ("tests.engine.test_logits_processors:_llm", r"logits_processors\[0\] must be a subclass of jaxpaged"),
    (int, r"logits_processors\[0\] must be a subclass of jaxpaged"),
])
def test_a_bad_processor_is_a_value_error_naming_logits_processors(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(logits_processors=[spec])


def test_the_cli_flag_loads_processors_by_module_and_class():
    import argparse

    from jaxpaged.cli import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    names = ["tests.engine.test_logits_processors:ForceToken", "tests.engine.test_logits_processors:ForceAt"]
    args = EngineArgs(**engine_kwargs(parser.parse_args(["--logits-processors", *names])))
    from jaxpaged.logits_processor import load_logits_processors
    assert load_logits_processors(args.logits_processors) == (ForceToken, ForceAt)
    assert engine_kwargs(parser.parse_args([]))["logits_processors"] is None


def test_processors_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="logits_processors must be a list"):
        EngineArgs(logits_processors=ForceToken)
    with pytest.raises(ValueError, match="logits_processors must be None with speculative_config"):
        EngineArgs(logits_processors=[ForceToken], speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="logits_processors must be None with runner='pooling'"):
        EngineArgs(logits_processors=[ForceToken], runner="pooling")


def _hf_no_repeat_outputs(prompt, n, max_tokens):
    """transformers' greedy generate with the same ban on the output only (its own no_repeat_ngram_size reads the
    prompt too)."""
    import torch
    from transformers import LogitsProcessor as HFProcessor, LogitsProcessorList

    from tests.tiny_models import hf_model

    class OutputNoRepeat(HFProcessor):
        def __call__(self, input_ids, scores):
            out = input_ids[0, len(prompt):].tolist()
            for j in range(len(out) - n + 1):
                if out[j:j + n - 1] == out[len(out) - n + 1:]:
                    scores[0, out[j + n - 1]] = -float("inf")
            return scores

    with torch.no_grad():
        ids = hf_model(tiny_checkpoint("llama")).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
            logits_processor=LogitsProcessorList([OutputNoRepeat()]))
    return ids[0, len(prompt):].tolist()


def _has_repeat(tokens, n):
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_processor_reading_the_output_tokens_matches_transformers_through_preemption(preemption_mode):
    """No repeated bigram or trigram, the very tokens of transformers with the same ban, in a pool too small for
    the batch: requests preempted (their slots' tokens written again when they come back) keep them."""
    prompts, max_tokens = PROMPTS[:4] * 2, 40
    sizes = [2, 3, 2, 0] * 2
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=16, max_model_len=64,
              max_num_seqs=8, max_num_batched_tokens=32, compile_on_startup=False, use_tqdm=False,
              logits_processors=[NoRepeatNGram], preemption_mode=preemption_mode, swap_space=64 * 6144 / 2**30)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             extra_args={"no_repeat_ngram_size": n} if n else None) for n in sizes]
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    assert llm.get_metrics()["jaxpaged:num_preemptions_total"] > 0
    assert outs[:4] == outs[4:]
    assert _has_repeat(outs[3], 2)   # the free answer repeats itself
    for prompt, n, tokens in zip(prompts[:3], sizes, outs):
        assert not _has_repeat(tokens, n)
        assert tokens == _hf_no_repeat_outputs(prompt, n, max_tokens)
