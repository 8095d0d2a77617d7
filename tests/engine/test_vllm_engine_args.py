"""Engine arguments vLLM scripts pass that concern what transformers loads: trust_remote_code, hf_overrides,
skip_tokenizer_init, tokenizer_mode, tokenizer_revision, download_dir; enforce_eager and pipeline_parallel_size=1
accepted."""

import argparse
import os

import pytest

from jaxpaged import LLM, EngineArgs, SamplingParams
from jaxpaged.cli import add_engine_args, engine_kwargs
from tests.tiny_models import tiny_checkpoint

TINY = dict(dtype="float32", block_size=8, num_gpu_blocks_override=32, compile_on_startup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_a_vllm_script_s_arguments_run():
    llm = LLM(tiny_checkpoint("llama"), trust_remote_code=True, enforce_eager=True, tokenizer_mode="slow",
              pipeline_parallel_size=1, **TINY)
    plain = LLM(tiny_checkpoint("llama"), **TINY)
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text == \
        plain.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text


def test_hf_overrides_change_the_config_the_model_is_built_from():
    dict_form = LLM(tiny_checkpoint("llama"), hf_overrides={"max_position_embeddings": 40}, **TINY)
    assert dict_form.llm_engine.max_model_len == 40
    assert dict_form.llm_engine.loaded.hf_config.max_position_embeddings == 40

    def longer(config):
        config.max_position_embeddings = 48
        return config
    assert LLM(tiny_checkpoint("llama"), hf_overrides=longer, **TINY).llm_engine.max_model_len == 48
    with pytest.raises(ValueError, match="must return the config"):
        LLM(tiny_checkpoint("llama"), hf_overrides=lambda config: None, **TINY)


def test_skip_tokenizer_init_takes_token_ids_only():
    llm = LLM(tiny_checkpoint("llama"), skip_tokenizer_init=True, **TINY)
    assert llm.get_tokenizer() is None
    out = llm.generate({"prompt_token_ids": [5, 17, 42]}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.text == ""
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate("Hello", GREEDY, use_tqdm=False)


def test_download_dir_is_where_a_hub_id_is_downloaded(monkeypatch, tmp_path):
    """A hub id's snapshot (the weights, and the tokenizer's files) goes to download_dir; the hub here is a stub
    that copies the tiny checkpoint where it is asked to (no network)."""
    import shutil
    import huggingface_hub
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, cache_dir=None):
        asked.append(cache_dir)
        folder = os.path.join(cache_dir or str(tmp_path / "default"), repo_id.replace("/", "--"))
        if not os.path.isdir(folder):
            shutil.copytree(tiny_checkpoint("llama"), folder)
        return folder
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    llm = LLM("someone/tiny-llama", download_dir=str(tmp_path / "weights"), **TINY)
    assert asked == [str(tmp_path / "weights")]
    assert llm.llm_engine.loaded.source.startswith(str(tmp_path / "weights"))
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text == \
        LLM(tiny_checkpoint("llama"), **TINY).generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineArgs(**engine_kwargs(parser.parse_args(["--download-dir", "/x"]))).download_dir == "/x"


@pytest.mark.parametrize("kwargs, name", [({"tokenizer_mode": "mistral"}, "tokenizer_mode"),
                                          ({"download_dir": ""}, "download_dir"),
                                          ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
                                          ({"hf_overrides": 3}, "hf_overrides"),
                                          ({"hf_overrides": "[1]"}, "hf_overrides"),
                                          ({"trust_remote_code": "yes"}, "trust_remote_code")])
def test_bad_values_are_value_errors_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EngineArgs(**kwargs)


def test_the_cli_takes_them():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--trust-remote-code", "--enforce-eager", "--skip-tokenizer-init", "--tokenizer-mode",
                            "slow", "--hf-overrides", '{"max_position_embeddings": 40}', "-pp", "1"])
    args = EngineArgs(**engine_kwargs(ns))
    assert args.trust_remote_code and args.enforce_eager and args.skip_tokenizer_init
    assert args.hf_overrides == {"max_position_embeddings": 40} and args.tokenizer_mode == "slow"
