"""Shared, cached loads of the built-in SmolLM2 GGUF for any test module.

Plain functions under `functools.cache` rather than pytest fixtures, so any test file can
import them and the expensive loads happen once per test session whatever the scope.
torch is imported inside the functions: importing this module stays cheap.
"""

import functools
import os

# The built-in model's engines compile at XLA's defaults, not at the suite's optimization_level 0
# (conftest.py): its steps' compute outweighs what level 0 saves in compiling (a full suite at 0:
# the quantized-accuracy tests 242 -> 633 s, the notebooks 397 -> 692 s, structured outputs 78 -> 218 s).
# Those engines and the notebooks' share one level, so their steps are shared through the run's cache.
BUILTIN_LEVEL = 2
# The quickstart notebook's CPU engine shape, which the RL and serving notebooks take too: the built-in
# model's tests use it so that one set of steps (with BUILTIN_LEVEL) is compiled per run and read back
# from the run's cache by the others (tests/notebooks checks the notebooks still say it).
QUICKSTART_SHAPE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)


@functools.cache
def smollm2_path() -> str:
    from jaxpaged.models.builtin import builtin_model_path

    return builtin_model_path()


def _folder_and_name() -> tuple[str, str]:
    path = smollm2_path()
    return os.path.dirname(path), os.path.basename(path)


@functools.cache
def smollm2_hf_model():
    """transformers' own float32 Llama loaded from the same GGUF: the reference."""
    from jaxpaged.benchmarks.throughput import builtin_hf_model

    return builtin_hf_model("float32")


@functools.cache
def smollm2_tokenizer():
    """transformers' tokenizer converted straight from the GGUF (no cache of ours)."""
    from transformers import AutoTokenizer

    folder, name = _folder_and_name()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@functools.cache
def smollm2_ours():
    """Our `load_gguf` result: (LlamaConfig, HF-named float32 numpy state dict)."""
    from jaxpaged.models.gguf_loader import load_gguf

    return load_gguf(smollm2_path())


@functools.cache
def smollm2_hf_on_our_tensors():
    """transformers' float32 Llama on our `load_gguf` tensors (~3 s, against ~13 s for smollm2_hf_model);
    test_gguf proves them transformers' own, tensor by tensor."""
    from jaxpaged.benchmarks.throughput import load_gguf_as_transformers

    return load_gguf_as_transformers(smollm2_path())
