"""GGUFFile reads what gguf.GGUFReader reads: every metadata value and every tensor view."""

import numpy as np
import pytest
from gguf import GGUFReader

from jaxpaged.models.builtin import builtin_model_path
from jaxpaged.models.gguf_file import GGUFFile


def _assert_same(path):
    ours, theirs = GGUFFile(path), GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]   # GGUFReader's header pseudo-fields
    assert keys and all(k in ours for k in keys)
    for key in keys:
        want = theirs.fields[key].contents()
        want = want.item() if isinstance(want, np.generic) else want
        assert ours.get(key) == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.shape == tuple(int(d) for d in b.shape) and a.tensor_type == b.tensor_type, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_builtin_model_reads_like_gguf_reader():
    _assert_same(builtin_model_path())


def test_tiny_file_of_every_value_type_reads_like_gguf_reader(tmp_path):
    import gguf
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("u8", 7); w.add_int16("i16", -3); w.add_uint64("u64", 2**40); w.add_float64("f64", 0.1)  # noqa: E702
    w.add_bool("flag", True); w.add_string("s", "héllo"); w.add_array("nums", [1, 2, 3])  # noqa: E702
    w.add_array("strs", ["a", "", "ü"]); w.add_float32("f32", 1e-5)  # noqa: E702
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("y", np.ones((2, 64), np.float16))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    _assert_same(path)
    assert GGUFFile(path).get("strs") == ["a", "", "ü"] and GGUFFile(path).array_length("strs") == 3


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="cut short"):
        GGUFFile(str(path))
