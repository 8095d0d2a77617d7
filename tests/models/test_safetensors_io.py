"""The safetensors reader: every dtype a checkpoint ships in reads back bit for bit."""

import json

import ml_dtypes
import numpy as np
import pytest

from jaxpaged.models.loader import load_model
from jaxpaged.models.safetensors_io import Checkpoint
from tests.tiny_models import tiny_checkpoint

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402  (needs torch)

# torch dtype -> (safetensors name, the ml_dtypes/numpy type we must return)
DTYPES = {
    torch.bfloat16: ("BF16", ml_dtypes.bfloat16),
    torch.float8_e4m3fn: ("F8_E4M3", ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: ("F8_E5M2", ml_dtypes.float8_e5m2),
    torch.float16: ("F16", np.float16),
    torch.float32: ("F32", np.float32),
    torch.int64: ("I64", np.int64),
}


def _tensors():
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        values = torch.randn(3 + i, 5, generator=gen) * 4   # spans fp8's coarse steps and its saturation
        out[f"t{i}.{str(dtype).removeprefix('torch.')}"] = values.to(dtype)
    out["scalar_bf16"] = torch.tensor(-1.5, dtype=torch.bfloat16)
    return out


def _same_bits(ours: np.ndarray, theirs) -> None:
    """Equal bit patterns (an exact check that also holds for NaN and -0.0)."""
    assert tuple(ours.shape) == tuple(theirs.shape)
    width = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
             8: (torch.int64, np.int64)}[theirs.element_size()]
    np.testing.assert_array_equal(np.ascontiguousarray(ours).view(width[1]), theirs.view(width[0]).numpy())


def test_every_dtype_reads_back_exactly(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = Checkpoint(str(tmp_path))
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, theirs in tensors.items():
        ours = ckpt.get(name)
        kind, np_type = DTYPES[theirs.dtype]
        assert ours.dtype == np.dtype(np_type), name
        assert ckpt._where[name].dtype_name(name) == kind
        _same_bits(ours, theirs)
        # values too, not just bits: the float types agree with torch's own float32 conversion
        if theirs.is_floating_point():
            np.testing.assert_array_equal(ours.astype(np.float32), theirs.float().numpy())


def test_float8_tensors_in_a_sharded_checkpoint(tmp_path):
    tensors = _tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / shard, metadata={"format": "pt"})
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ckpt = Checkpoint(str(tmp_path))
    for name, theirs in tensors.items():
        _same_bits(ckpt.get(name), theirs)
    assert "missing" not in ckpt
    with pytest.raises(KeyError):
        ckpt.get("missing")


def test_bfloat16_checkpoint_loads_as_bfloat16_with_its_values(tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))   # dtype="auto" follows the checkpoint
    assert loaded.dtype == "bfloat16"
    embed = model.model.embed_tokens.weight.detach()
    _same_bits(np.asarray(loaded.model.embed[...]), embed)
