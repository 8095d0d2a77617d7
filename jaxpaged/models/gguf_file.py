"""A GGUF file's metadata and tensor index, read in milliseconds.

`gguf.GGUFReader` builds a numpy memmap view for every part of every metadata value: on the
built-in model (98k tokenizer strings) opening the file takes ~10 s, most of an engine's
start-up. This reads the same header with `struct` over one memory map, keeps string arrays
as undecoded offsets until a key is asked for, and gives tensors as the same memmap views
GGUFReader gives (so `gguf.quants.dequantize` takes them unchanged).

    GGUF = magic "GGUF", version u32, tensor count u64, metadata count u64,
           metadata (key, type u32, value)..., tensor infos (name, dims, type u32, offset u64)...,
           padding to `general.alignment` (default 32), tensor data
"""

import dataclasses
import mmap
import struct

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]             # GGUF order: fastest-varying dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray                   # a read-only view of the file: elements, or bytes per row when quantized


@dataclasses.dataclass
class _StringArray:
    offset: int
    count: int


class GGUFFile:
    """The metadata (`get`) and tensors (`tensors`) of a GGUF file; raises ValueError when the
    file is not GGUF or is cut short."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            if self._buf[:4] != b"GGUF":
                raise ValueError(f"{path!r} is not a GGUF file (its first bytes are {self._buf[:4]!r})")
            self._pos = 4
            version, num_tensors, num_fields = self._read("<I"), self._read("<Q"), self._read("<Q")
            if version < 2:
                raise ValueError(f"{path!r} is GGUF version {version}; versions 2 and 3 are supported")
            self._fields = {}
            for _ in range(num_fields):
                key = self._string()
                self._fields[key] = self._value(GGUFValueType(self._read("<I")))
            infos = []
            for _ in range(num_tensors):
                name = self._string()
                dims = tuple(self._read("<Q") for _ in range(self._read("<I")))
                infos.append((name, dims, GGMLQuantizationType(self._read("<I")), self._read("<Q")))
            alignment = int(self.get("general.alignment", 32))
            data_start = -(-self._pos // alignment) * alignment
            self.tensors = [self._tensor(data_start, *info) for info in infos]
        except (struct.error, IndexError) as exc:
            raise ValueError(f"{path!r} is cut short or corrupt: {exc}") from None

    def get(self, key: str, default=None):
        """A metadata value as Python data (str, int, float, bool, or a list of them), or `default`."""
        value = self._fields.get(key, default)
        if isinstance(value, _StringArray):
            pos, self._pos = self._pos, value.offset
            value = [self._string() for _ in range(value.count)]
            self._pos = pos
        return value

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def array_length(self, key: str) -> int | None:
        value = self._fields.get(key)
        if value is None:
            return None
        return value.count if isinstance(value, _StringArray) else len(value)

    # ---- parsing ----------------------------------------------------------------------------
    def _read(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        text = self._buf[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, kind: GGUFValueType):
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._read(_SCALARS[kind])
        item, count = GGUFValueType(self._read("<I")), self._read("<Q")
        if item == GGUFValueType.STRING:
            array = _StringArray(self._pos, count)
            for _ in range(count):   # skip: only the lengths are read
                self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
            return array
        if item == GGUFValueType.ARRAY:
            return [self._value(GGUFValueType.ARRAY) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        values = np.frombuffer(self._buf, dtype, count, self._pos).tolist()
        self._pos += dtype.itemsize * count
        return values

    def _tensor(self, data_start: int, name: str, dims: tuple, kind: GGMLQuantizationType, offset: int):
        shape = tuple(reversed(dims))
        if kind in _NUMPY:
            dtype, count = np.dtype(_NUMPY[kind]), int(np.prod(dims))
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), int(np.prod(dims)) // block_size * type_size
            shape = quant_shape_to_byte_shape(shape, kind)
        data = np.frombuffer(self._buf, dtype, count, data_start + offset).reshape(shape)
        return GGUFTensor(name, dims, kind, data)
