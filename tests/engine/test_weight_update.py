"""Research loops: weights written in place under Hugging Face names, pause and resume, sleep and
wake. An updated engine gives what an engine built on the new weights gives, token for token."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.tiny_models import scratch_folder, tiny_checkpoint

OPTS = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=128, compile_on_startup=False, block_size=8)
PROMPTS = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(40, 49))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)


def run(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs]


def same(a, b):
    return a[0] == b[0] and np.allclose(a[1], b[1], atol=1e-4)


def hf_state(path: str) -> dict[str, np.ndarray]:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def save_like(path: str, state: dict[str, np.ndarray]) -> str:
    """A checkpoint with `path`'s config and `state`'s weights."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()})
    out = os.path.join(scratch_folder("updated-"), "model")
    model.save_pretrained(out)
    return out


@functools.cache
def other_weights(arch: str) -> tuple[dict, str]:
    """Checkpoint B: checkpoint A's architecture, every weight moved."""
    rng = np.random.default_rng(1)
    original = hf_state(tiny_checkpoint(arch))
    state = {k: v + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for k, v in original.items()}
    if "lm_head.weight" in state and np.array_equal(original["lm_head.weight"], original["model.embed_tokens.weight"]):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]   # tied: one tensor
    return state, save_like(tiny_checkpoint(arch), state)


# biases + untied head; tied, unrolled; LayerNorms with biases (the final one's too) and an ungated MLP
@pytest.mark.parametrize("arch, scan", [("qwen2", True), ("llama", False), ("nemotron", True)])
def test_every_weight_of_b_makes_a_into_b(arch, scan):
    state, path_b = other_weights(arch)
    want = run(LLM(path_b, scan_layers=scan, **OPTS))
    llm = LLM(tiny_checkpoint(arch), scan_layers=scan, **OPTS)
    before = run(llm)
    llm.update_weights({k: jnp.asarray(v) for k, v in state.items()})   # JAX arrays in
    assert same(run(llm), want) and not same(before, want)


def test_one_layer_updated_matches_transformers_with_that_layer_replaced():
    import torch
    import transformers
    path = tiny_checkpoint("qwen2")
    name = "model.layers.1.self_attn.k_proj.weight"   # the middle of the fused q|k|v columns
    new = np.random.default_rng(2).standard_normal(hf_state(path)[name].shape).astype(np.float32) * 0.2
    llm = LLM(path, **OPTS)
    llm.update_weights([(name, new)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        hf.get_parameter(name).copy_(torch.from_numpy(new))
        want = hf.generate(torch.tensor([PROMPTS[0]["prompt_token_ids"]]), max_new_tokens=8, do_sample=False)[0, 20:]
    assert run(llm)[0][0] == want.tolist()


def test_rollouts_after_each_jax_update_match_a_fresh_engine():
    """The loop a researcher writes: rollouts, a JAX change of the weights, update_weights, rollouts."""
    path = tiny_checkpoint("llama")
    params = {k: jnp.asarray(v) for k, v in hf_state(path).items()}
    llm = LLM(path, **OPTS)

    @jax.jit
    def train_step(params, scale):   # a deterministic "gradient step" on every matrix
        return {k: v - scale * jnp.tanh(v) if v.ndim == 2 else v for k, v in params.items()}

    for step in range(2):
        params = train_step(params, 0.02 * (step + 1))
        llm.update_weights(params)
        fresh = LLM(save_like(path, {k: np.asarray(v) for k, v in params.items()}), **OPTS)
        assert same(run(llm), run(fresh)), f"after update {step + 1}"


@pytest.mark.parametrize("weights, match", [
    ({"model.layers.0.mlp.up_prj.weight": np.zeros((128, 64), np.float32)}, "up_prj"),
    ({"model.layers.0.mlp.up_proj.weight": np.zeros((64, 128), np.float32)}, r"up_proj.weight has shape \[64, 128\]"),
    ({"model.norm.weight": np.zeros(64, np.int32)}, "model.norm.weight has dtype int32"),
])
def test_bad_updates_are_value_errors_and_write_nothing(weights, match):
    llm = LLM(tiny_checkpoint("llama"), **OPTS)
    before = run(llm)
    good = {"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)}
    with pytest.raises(ValueError, match=match):
        llm.update_weights({**good, **weights})
    assert same(run(llm), before), "a refused update changed the model"


def test_quantized_engine_refuses_update_by_name():
    llm = LLM(tiny_checkpoint("llama"), **{**OPTS, "quantization": "int8"})
    with pytest.raises(ValueError, match="quantization=None"):
        llm.update_weights({"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)})


def test_update_resets_the_prefix_cache_and_waits_for_requests_unless_paused():
    state, path_b = other_weights("llama")
    llm = LLM(tiny_checkpoint("llama"), **OPTS)
    engine = llm.llm_engine
    old = run(llm)
    engine.add_request("r", PROMPTS[0], GREEDY)
    engine.step()
    outputs = engine.update_weights(state)   # not paused: "r" finishes on the old weights first
    assert [o.outputs[0].token_ids for o in outputs if o.finished] == [old[0][0]]
    hits = llm.get_metrics()["jaxpaged:prefix_cache_hits_total"]
    assert same(run(llm), run(LLM(path_b, **OPTS)))   # the prompts' cached blocks were not reused
    assert llm.get_metrics()["jaxpaged:prefix_cache_hits_total"] == hits
    engine.add_request("p", PROMPTS[1], GREEDY)
    engine.step()
    llm.pause_generation()
    assert engine.step() == [] and engine.update_weights(hf_state(tiny_checkpoint("llama"))) == []
    assert engine.has_unfinished_requests()   # paused: it waits, and goes on on the new weights
    llm.resume_generation()
    while engine.has_unfinished_requests():
        engine.step()


def device_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")


def test_sleep_gives_device_memory_back_and_wake_up_restores_the_outputs():
    llm = LLM(tiny_checkpoint("llama"), **OPTS)
    before = run(llm)
    runner = llm.llm_engine.runner
    pool = runner.kv_pool.nbytes
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.state))
    awake = device_bytes()
    llm.sleep(1)
    assert llm.is_sleeping() and awake - device_bytes() >= pool + weights
    with pytest.raises(ValueError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and same(run(llm), before)
    llm.sleep(2)   # weights dropped: the caller writes them after wake_up
    llm.wake_up()
    llm.update_weights(hf_state(tiny_checkpoint("llama")))
    assert same(run(llm), before)


def test_sleep_with_requests_unfinished_is_refused():
    llm = LLM(tiny_checkpoint("llama"), **OPTS)
    llm.llm_engine.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="unfinished"):
        llm.sleep()
    with pytest.raises(ValueError, match="level"):
        llm.llm_engine.sleep(3)
