"""Read Hugging Face safetensors checkpoints (single file or sharded) lazily, tensor by tensor.

`safetensors.safe_open(..., framework="numpy")` memory-maps each file and copies out one
tensor per `get`, so loading never holds more than the converted weights plus one tensor.
numpy, not "flax"/"jax": those frameworks put every tensor on the default device, and the
loader then casts, transposes and stacks it on the host, a device round trip per tensor.
bfloat16 and the float8 types come through `ml_dtypes` (importing it teaches numpy the name
"bfloat16", which safetensors asks numpy for).
"""

import json
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

# safetensors (0.8) looks these up as attributes of numpy, which lacks them (safetensors
# issue #682), so their bytes are read from the file and typed here.
_FLOAT8_DTYPES = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        self._file = safe_open(path, framework="numpy")
        self.dtypes: dict[str, str] = {name: self._file.get_slice(name).get_dtype() for name in self._file.keys()}
        self._float8_offsets: dict[str, tuple[int, int]] | None = None

    def names(self) -> list[str]:
        return list(self.dtypes)

    def get(self, name: str) -> np.ndarray:
        """A host copy of one tensor, in its stored dtype."""
        kind = self.dtypes[name]
        if kind in _FLOAT8_DTYPES:
            return self._get_float8(name, np.dtype(_FLOAT8_DTYPES[kind]))
        try:
            return self._file.get_tensor(name)
        except (AttributeError, TypeError) as exc:   # a dtype numpy cannot hold (e.g. F4)
            raise ValueError(f"tensor {name!r} in {self.path} has unsupported dtype {kind}") from exc

    def _get_float8(self, name: str, dtype: np.dtype) -> np.ndarray:
        if self._float8_offsets is None:
            # The header's data_offsets count from the end of the header (8-byte length + JSON).
            with open(self.path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            self._float8_offsets = {}   # name -> (file offset, byte count)
            for key, entry in header.items():
                start, end = entry["data_offsets"]
                self._float8_offsets[key] = (8 + header_len + start, end - start)
        offset, nbytes = self._float8_offsets[name]
        shape = self._file.get_slice(name).get_shape()
        return np.fromfile(self.path, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).reshape(shape)

    def dtype_name(self, name: str) -> str:
        return self.dtypes[name]


class Checkpoint:
    """All tensors of a folder's safetensors files, by name."""

    def __init__(self, folder: str):
        index_path = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        if not shard_names:
            raise FileNotFoundError(f"no *.safetensors weights found in {folder!r} (only safetensors "
                                    "checkpoints and .gguf files are supported)")
        self.files = [SafetensorsFile(os.path.join(folder, n)) for n in shard_names]
        self._where = {name: f for f in self.files for name in f.names()}

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(name)
        return self._where[name].get(name)

    def dtype_name(self) -> str:
        """The dtype of most floating tensors (what dtype="auto" means)."""
        counts: dict[str, int] = {}
        for name, f in self._where.items():
            kind = f.dtype_name(name)
            if kind in ("F32", "F16", "BF16"):
                counts[kind] = counts.get(kind, 0) + 1
        return max(counts, key=counts.get) if counts else "F32"
