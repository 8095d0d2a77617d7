"""Prompt embeddings (vLLM's `enable_prompt_embeds`, `{"prompt_embeds": tensor}`): a prompt given as
rows of the model's input embeddings instead of token ids.

A prompt of embeddings runs as a prompt of placeholder token ids (0s) whose rows the step takes
from the embeddings instead of the embedding table; its prefix-cache blocks are hashed with a
SHA-256 of their rows (`block_digests`), so only equal embeddings share K/V, and never a prompt of
real 0 tokens. Everything after the prompt is ordinary tokens.

`as_embeds` takes what users hold: a NumPy or JAX array, a (CPU or GPU) torch tensor (read without
importing torch), or nested lists. `decode_base64` reads the HTTP form: vLLM's base64 of
`torch.save(tensor)` (a zip holding a pickle), parsed here by a restricted unpickler that builds
nothing but the array, or a base64 NumPy `.npy` file.
"""

import base64
import binascii
import hashlib
import io
import pickle
import zipfile

import ml_dtypes
import numpy as np


def host_array(value, field: str = "prompt_embeds") -> np.ndarray:
    """A NumPy array, a torch tensor (bfloat16 as float32: it has no NumPy view) or nested lists as a NumPy
    array of numbers; ValueError naming `field` for anything else."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field} must be an array, got {type(value).__name__} ({exc})") from None
    if array.dtype.kind not in "fiu" and array.dtype not in (ml_dtypes.bfloat16,):
        raise ValueError(f"{field} must hold numbers, got dtype {array.dtype}")
    return array


def as_embeds(value, hidden_size: int, dtype, field: str = "prompt_embeds") -> np.ndarray:
    """`value` as a C-contiguous array [tokens, hidden_size] of `dtype` (the model's activations).
    ValueError naming `field` for anything else: another rank or width, no rows, a value that is not
    finite."""
    array = host_array(value, field)
    if array.ndim != 2 or array.shape[1] != hidden_size:
        raise ValueError(f"{field} must have shape [tokens, hidden_size={hidden_size}], got {list(array.shape)}")
    if array.shape[0] == 0:
        raise ValueError(f"{field} must hold at least 1 row (got 0)")
    array = np.ascontiguousarray(array.astype(dtype))
    if not np.isfinite(array.astype(np.float32)).all():
        raise ValueError(f"{field} must be finite in {np.dtype(dtype).name} (it holds inf or nan)")
    return array


def block_digests(embeds: np.ndarray, block_size: int) -> tuple[bytes, ...]:
    """SHA-256 of each block's rows (the last block's rows may be fewer): what the prefix cache adds
    to a block's hash (kv_cache_manager.hash_block's `extra`)."""
    return tuple(hashlib.sha256(embeds[i:i + block_size].tobytes()).digest()
                 for i in range(0, len(embeds), block_size))


# torch.save's storage classes -> NumPy dtypes
_STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
             "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32}


def _rebuild_tensor(storage, offset, size, stride, *_):
    """The tensor's view of its storage, copied; its sizes and strides checked to stay inside the storage
    (as_strided reads whatever they point at)."""
    size, stride = tuple(size), tuple(stride)
    ints = all(isinstance(v, int) and v >= 0 for v in (offset, *size, *stride))
    if not ints or len(size) != len(stride):
        raise ValueError(f"a tensor of sizes {size} and strides {stride} at {offset}")
    extent = offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1 if all(size) else offset
    if extent > len(storage):
        raise ValueError(f"a tensor of sizes {size} and strides {stride} reaches past its storage of {len(storage)}")
    itemsize = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], size, tuple(st * itemsize for st in stride)).copy()


class _TorchUnpickler(pickle.Unpickler):
    """torch.save's data.pkl for one tensor: its storage classes and `_rebuild_tensor_v2`, nothing else."""

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor's part")

    def persistent_load(self, pid):
        kind, dtype, key = pid[0], pid[1], pid[2]
        if kind != "storage" or dtype not in _STORAGES.values():
            raise pickle.UnpicklingError(f"unsupported storage {pid[:2]!r}")
        return np.frombuffer(self.archive.read(f"{self.prefix}data/{key}"), dtype)


def _read_torch(raw: bytes, field: str) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        value = _TorchUnpickler(archive.read(pkl), archive, pkl[:-len("data.pkl")]).load()
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{field} must hold one tensor, got {type(value).__name__}")
    return value


def decode_base64(text, field: str = "prompt_embeds", kinds: str = "f") -> np.ndarray:
    """One base64 tensor of the HTTP form (a `prompt_embeds` entry; an image_embeds part): torch.save(tensor)
    or a NumPy .npy file, of a dtype of `kinds` (NumPy's kind letters: "f" float32, float16, bfloat16 or
    float64; "i", "u" integers). ValueError naming `field` for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be base64 strings, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field} must be base64 (of torch.save(tensor) or a .npy file)") from None
    try:
        if raw.startswith(b"\x93NUMPY"):
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        elif raw.startswith(b"PK"):
            array = _read_torch(raw, field)
        else:
            raise ValueError(f"{field} must be base64 of torch.save(tensor) or of a NumPy .npy file")
    except (pickle.UnpicklingError, zipfile.BadZipFile, KeyError, StopIteration, EOFError, TypeError,
            IndexError) as exc:
        raise ValueError(f"{field} could not be read as a tensor ({exc})") from None
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith(field) else f"{field} could not be read as a tensor "
                                                                     f"({exc})") from None
    kind = "f" if array.dtype == ml_dtypes.bfloat16 else array.dtype.kind
    if kind not in kinds:
        raise ValueError(f"{field} must hold {'floats' if kinds == 'f' else 'numbers'}, got {array.dtype}")
    return array
