"""Read Hugging Face safetensors checkpoints (single file or sharded) lazily, tensor by tensor.

The files are memory-mapped and each tensor is a zero-copy numpy view until it is cast,
so loading never holds more than the converted weights plus one tensor. bfloat16 comes
through `ml_dtypes`, which numpy alone lacks.
"""

import json
import mmap
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (header_len,) = struct.unpack("<Q", self._mmap[:8])
        header = json.loads(self._mmap[8:8 + header_len])
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.entries: dict[str, dict] = header

    def get(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} in {self.path} has unsupported dtype {entry['dtype']}")
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        start, end = entry["data_offsets"]
        count = (end - start) // dtype.itemsize
        array = np.frombuffer(self._mmap, dtype=dtype, count=count, offset=self._data_start + start)
        return array.reshape(entry["shape"])

    def dtype_name(self, name: str) -> str:
        return self.entries[name]["dtype"]


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
        self._where = {name: f for f in self.files for name in f.entries}

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
