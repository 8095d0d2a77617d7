"""load_format="dummy" (vLLM's): a model from its config alone, random weights in the checkpoint's
layout (same names, shapes, dtypes and placement as loading the weights), uniform in +-1e-3; it
generates; bad values are named."""

import os
import shutil

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.dummy import DUMMY_RANGE
from jaxpaged.models.loader import load_model
from jaxpaged.parallel import ShardPlan
from tests.tiny_models import tiny_checkpoint


def config_only(tmp_path, arch: str = "llama") -> str:
    """A folder holding the tiny checkpoint's config.json and nothing else (no weights, no tokenizer)."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(os.path.join(tiny_checkpoint(arch), "config.json"), folder / "config.json")
    return str(folder)


def arrays(loaded) -> dict:
    """name -> array of every weight (the model's fp8 KV scales too)."""
    from flax import nnx
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(loaded.model, nnx.Param))
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def structure(loaded) -> dict:
    """name -> (shape, dtype, sharding) of every weight array of a loaded model."""
    return {name: (x.shape, x.dtype, x.sharding) for name, x in arrays(loaded).items()}


@pytest.mark.parametrize("arch,scan_layers,quantization", [("llama", None, None), ("qwen2", False, None),
                                                           ("llama", True, "int8")])
def test_dummy_weights_take_the_checkpoints_layout(tmp_path, arch, scan_layers, quantization):
    plan = ShardPlan(device=jax.devices()[0])   # placed, as a data-parallel replica's are
    real = load_model(tiny_checkpoint(arch), "float32", scan_layers=scan_layers, shard_plan=plan,
                      quantization=quantization)
    dummy = load_model(config_only(tmp_path, arch), "float32", scan_layers=scan_layers, shard_plan=plan,
                       quantization=quantization, load_format="dummy")
    assert structure(dummy) == structure(real)
    assert dummy.config == real.config and dummy.quantization == real.quantization
    floats = [np.asarray(x) for name, x in arrays(dummy).items()
              if x.dtype == np.float32 and "kv_scales" not in name]   # the model's own, 1.0
    assert all(np.abs(x).max() <= DUMMY_RANGE for x in floats)
    assert np.std(np.concatenate([x.ravel() for x in floats])) > DUMMY_RANGE / 4   # drawn, not zeros


def test_a_dummy_model_generates_from_its_config_alone(tmp_path):
    folder = config_only(tmp_path)
    llm = LLM(folder, load_format="dummy", compile_on_startup=False, max_model_len=64, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs,argument", [(dict(load_format="pt"), "load_format"),
                                             (dict(model="x.gguf", load_format="dummy"), "dummy")])
def test_bad_load_formats_are_named(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        LLM(**{"model": None, **kwargs}, compile_on_startup=False)


def test_the_load_format_flag_reaches_the_engine_arguments():
    import argparse

    from jaxpaged.cli import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--load-format", "dummy"]))["load_format"] == "dummy"
    assert engine_kwargs(parser.parse_args([]))["load_format"] == "auto"
