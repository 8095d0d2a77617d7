"""Shared, cached loads of the built-in SmolLM2 GGUF for any test module.

Plain functions under `functools.cache` rather than pytest fixtures, so any test file can
import them and the expensive loads happen once per test session whatever the scope.
torch is imported inside the functions: importing this module stays cheap.
"""

import functools
import os


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
    from jaxpaged.bench.throughput import builtin_hf_model

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
