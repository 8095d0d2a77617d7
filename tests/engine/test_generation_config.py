"""generation_config.json honoured as vLLM's generation_config="auto": EOS ids and sampling defaults."""

import functools
import json
import os
import shutil

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.generation_config import load_generation_defaults
from tests.tiny_models import scratch_folder, tiny_checkpoint

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 3]}


def _engine(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=48, max_model_len=64,
               max_num_seqs=4, compile_on_startup=False, **kwargs)


@functools.cache
def _greedy_tokens() -> list[int]:
    out = _engine(tiny_checkpoint("llama")).generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                                            ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@functools.cache
def _checkpoint_with_generation_config() -> tuple[str, int]:
    """The tiny llama plus a generation_config.json: greedy through top_k=1, and an extra EOS id that
    greedy decoding reaches at its 5th token (chosen so it appears nowhere earlier)."""
    tokens = _greedy_tokens()
    index = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] != 2)
    folder = scratch_folder("genconfig-")
    shutil.copytree(tiny_checkpoint("llama"), folder, dirs_exist_ok=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, tokens[index]], "top_k": 1, "temperature": 0.9, "do_sample": True}, f)
    return folder, index


@functools.cache
def _llm(mode: str) -> LLM:
    return _engine(_checkpoint_with_generation_config()[0], generation_config=mode)


def test_generation_config_eos_ids_end_generation():
    _, index = _checkpoint_with_generation_config()
    out = _llm("auto").generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _greedy_tokens()[:index + 1]
    assert out.outputs[0].finish_reason == "stop"
    off = _llm("vllm").generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert list(off.outputs[0].token_ids) == _greedy_tokens()


def test_generation_config_sampling_defaults_fill_only_unset_fields():
    _, index = _checkpoint_with_generation_config()
    greedy = _greedy_tokens()[:index + 1]
    llm = _llm("auto")
    assert llm.get_default_sampling_params().top_k == 1
    assert llm.get_default_sampling_params().temperature == 0.9
    # top_k=1 from the file makes seeded sampling greedy, for every seed
    for seed in range(3):
        out = llm.generate(PROMPT, SamplingParams(seed=seed, max_tokens=12), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == greedy
    # an explicit top_k wins: seeded sampling leaves the greedy path for some seed
    explicit = [list(llm.generate(PROMPT, SamplingParams(seed=s, top_k=0, max_tokens=12, temperature=1.5),
                                  use_tqdm=False)[0].outputs[0].token_ids) for s in range(3)]
    assert any(t != greedy for t in explicit)
    # generation_config="vllm": the engine's own defaults (top_k off), so sampling is not greedy
    off = [list(_llm("vllm").generate(PROMPT, SamplingParams(seed=s, temperature=1.5, max_tokens=12),
                                      use_tqdm=False)[0].outputs[0].token_ids) for s in range(3)]
    assert any(t[:len(greedy)] != greedy for t in off)
    assert _llm("vllm").get_default_sampling_params() == SamplingParams()


def test_generation_config_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="generation_config"):
        load_generation_defaults(str(tmp_path), None)   # a folder without the file
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ValueError, match="top_p"):
        load_generation_defaults(str(tmp_path), None)
    assert load_generation_defaults("auto", None).sampling == {}


def test_cache_salt_keeps_tenants_apart():
    llm = _engine(tiny_checkpoint("llama"))
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(salt):
        p = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        return llm.generate(p, params, use_tqdm=False)[0].num_cached_tokens

    assert cached("a") == 0
    assert cached(None) == 0 and cached("b") == 0
    assert cached("a") == 32 and cached("b") == 32 and cached(None) == 32
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, params, use_tqdm=False)
