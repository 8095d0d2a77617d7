"""Load a llama.cpp GGUF checkpoint as a Hugging Face `LlamaConfig` plus a float32 state dict.

The weights come back named and shaped exactly like transformers' Llama state dict, so
the same Flax conversion code serves safetensors and GGUF checkpoints alike. The one thing
HF's Llama has no slot for, llama.cpp's per-frequency rope factors (`rope_freqs.weight`),
rides on the config as `rope_freq_factors`.
"""

import logging
import os
import re
import shutil
import tempfile
import warnings

import numpy as np
import transformers
from gguf.quants import dequantize

from jaxpaged.models.gguf_file import GGUFFile
from jaxpaged.models.gguf_tokenizer import build_gguf_tokenizer
from jaxpaged.models.quantization import GGUF_NATIVE, from_gguf_blocks

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name inside a block -> HF name inside `model.layers.{i}`.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def open_gguf(path: str) -> GGUFFile:
    """The file's header and tensor index (tensor data is memory-mapped, read on use); a
    ValueError for an architecture this loader does not map."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: path={path!r}")
    reader = GGUFFile(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF general.architecture={arch!r} in {path!r}; "
            f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return reader


def _field(reader: GGUFFile, key: str, default=None):
    # float32 values arrive widened exactly (1e-5 is 9.999999747378752e-06), the value
    # transformers puts in its config too
    return reader.get(key, default)


def _rope_parameters(reader: GGUFFile) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))}
    scaling_type = _field(reader, "llama.rope.scaling.type")
    factor = _field(reader, "llama.rope.scaling.factor")
    if scaling_type is None and _field(reader, "llama.rope.scale_linear") is not None:
        # Older converters wrote only this key, which always meant linear scaling.
        scaling_type, factor = "linear", _field(reader, "llama.rope.scale_linear")
    if scaling_type in (None, "none") or factor is None or (scaling_type == "linear" and factor in (0.0, 1.0)):
        return rope
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(
            f"unsupported GGUF llama.rope.scaling.type={scaling_type!r}; supported: 'none', 'linear', 'yarn'"
        )
    rope.update(rope_type=scaling_type, factor=float(factor))
    if scaling_type == "yarn":
        original = _field(reader, "llama.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
        # llama.cpp's yarn attn_factor multiplies on top of the mscale that HF derives from
        # `factor`, so it is not HF's attention_factor and is left out on purpose.
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, f"llama.rope.scaling.{gguf_key}")
            if value is not None:
                rope[hf_key] = float(value)
    return rope


def _rope_freq_factors(reader: GGUFFile, head_dim: int) -> tuple[float, ...] | None:
    """The divisors of each rotary frequency [head_dim // 2], or None when the file has none.

    llama.cpp's converter writes llama3 rope scaling (Llama 3.1/3.2) as this tensor rather than
    as metadata, and llama.cpp divides frequency i by factor i: theta_i = pos * base^(-2i/d) / f_i.
    """
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None:
        return None
    factors = dequantize(tensor.data, tensor.tensor_type).reshape(-1).astype(np.float64)
    if factors.size != head_dim // 2:
        raise ValueError(f"GGUF tensor {ROPE_FREQS_TENSOR!r} has {factors.size} values, expected "
                         f"head_dim // 2 = {head_dim // 2} (one factor per rotary frequency)")
    if not np.all(np.isfinite(factors) & (factors > 0)):
        raise ValueError(f"GGUF tensor {ROPE_FREQS_TENSOR!r} holds a factor that is not a positive "
                         f"finite number: {factors.tolist()}")
    return tuple(factors.tolist())


def _config(reader: GGUFFile) -> transformers.LlamaConfig:
    hidden_size = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    vocab_size = _field(reader, "llama.vocab_size")
    if vocab_size is None:  # some converters only write the token list
        vocab_size = reader.array_length("tokenizer.ggml.tokens")
    kwargs = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rope_parameters=_rope_parameters(reader),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    key_length = _field(reader, "llama.attention.key_length")
    if key_length is not None:
        kwargs["head_dim"] = int(key_length)
    freq_factors = _rope_freq_factors(reader, kwargs.get("head_dim", hidden_size // num_heads))
    if freq_factors is not None:
        kwargs["rope_freq_factors"] = freq_factors   # read by models.config.model_config_from_hf
    return transformers.LlamaConfig(**kwargs)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"
    return None


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for q/k projections.

    HF rotates pairs (i, i + head_dim/2) within a head; llama.cpp rotates adjacent pairs
    (2i, 2i + 1), so its converter interleaved each head's two halves. Per head the GGUF
    rows are [x0, y0, x1, y1, ...]; HF wants [x0, x1, ..., y0, y1, ...].
    """
    out_features, in_features = weight.shape
    half = out_features // num_heads // 2
    heads = weight.reshape(num_heads, half, 2, in_features)
    return heads.swapaxes(1, 2).reshape(out_features, in_features)


def _reader(source: str | GGUFFile) -> GGUFFile:
    return source if isinstance(source, GGUFFile) else open_gguf(source)


def quantized_tensor_types(source: str | GGUFFile) -> set[str]:
    """The quantized GGUF tensor types in the file (e.g. {"Q4_1", "Q8_0"}); empty for float files."""
    return {t.tensor_type.name for t in _reader(source).tensors
            if t.tensor_type.name not in ("F32", "F16", "BF16", "F64")}


def num_elements(source: str | GGUFFile) -> int:
    """How many values the file's tensors hold (their float32 size / 4)."""
    return sum(int(np.prod(t.shape)) for t in _reader(source).tensors)


def load_gguf(source: str | GGUFFile, keep_quantized: bool = False) -> tuple[transformers.PretrainedConfig, dict]:
    """Read a llama GGUF file; returns (LlamaConfig, HF-named float32 state dict).

    Tensors are dequantized one at a time from the memory-mapped file, so peak memory
    stays near one float32 copy of the weights. `lm_head.weight` is present only when
    the file has an untied `output.weight`. A `rope_freqs.weight` tensor becomes the config's
    `rope_freq_factors` (not a state dict entry); one of the wrong length raises ValueError.
    With `keep_quantized`, Q8_0, Q4_0 and Q4_1 matrices come back as `HostQuantized` [out, in]
    (their own blocks' scales and minimums) and other quantized types are dequantized, logged once.
    """
    reader = _reader(source)
    path = reader.path
    config = _config(reader)
    state: dict = {}
    dequantized: set[str] = set()
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue   # already in config.rope_freq_factors
        name = _hf_name(tensor.name)
        if name is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} in llama GGUF {path!r}")
        kind = tensor.tensor_type.name
        if keep_quantized and kind in GGUF_NATIVE and len(tensor.shape) == 2:
            rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
            weight = from_gguf_blocks(kind, tensor.data, rows, cols)
            if name.endswith(("q_proj.weight", "k_proj.weight")):   # the row permutation, on every field alike
                heads = config.num_attention_heads if name.endswith("q_proj.weight") else config.num_key_value_heads
                weight = weight.map_fields(lambda a: _unpermute_rope_rows(a, heads))
            state[name] = weight
            continue
        if keep_quantized and kind not in ("F32", "F16", "BF16", "F64"):
            dequantized.add(kind)
        weight = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; the dequantized array is already row-major
        # [out_features, in_features], i.e. tensor.shape reversed.
        weight = weight.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rope_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rope_rows(weight, config.num_key_value_heads)
        if np.may_share_memory(weight, tensor.data):  # F32 tensors are views of the mmap
            weight = weight.copy()
        state[name] = np.ascontiguousarray(weight, dtype=np.float32)
    if dequantized:
        logger.info("GGUF tensor types %s are de-quantized to float (kept quantized: %s)",
                    ", ".join(sorted(dequantized)), ", ".join(GGUF_NATIVE))
    return config, state


def _tokenizer_cache_dir(path: str) -> str:
    root = os.environ.get("JAXPAGED_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged"))
    stat = os.stat(path)
    # size and mtime change whenever the file is replaced, so a stale cache is never reused.
    # the -v2 tag: caches of the builder before it (transformers' converter, which needs torch) are not reused
    return os.path.join(root, "tokenizers",
                        f"{os.path.basename(path)}-{stat.st_size}-{stat.st_mtime_ns}-v2")


def load_gguf_tokenizer(path: str):
    """Return the tokenizer of a GGUF file (chat template included), built without torch.

    Building it takes about a second (SmolLM2: 98k vocabulary and merge strings), so it is saved
    once under $JAXPAGED_CACHE (default ~/.cache/jaxpaged) and later calls load it from there.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: path={path!r}")
    cache_dir = _tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cache_dir, "tokenizer_config.json")):
        return transformers.PreTrainedTokenizerFast.from_pretrained(cache_dir)
    tokenizer = build_gguf_tokenizer(path)
    try:
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        # Save to a private folder then rename, so a concurrent reader never sees half a cache.
        staging = tempfile.mkdtemp(dir=os.path.dirname(cache_dir))
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, cache_dir)
        except OSError:  # another process won the race; its copy is equally good
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:  # a read-only home must not stop serving
        warnings.warn(f"could not cache tokenizer in {cache_dir}: {err}")
    return tokenizer
