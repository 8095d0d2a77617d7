"""The benchmarks' reused folders (a converted checkpoint under the temp dir) are named by what they
come from: a reinstalled copy of the same file reuses the folder, a changed file gets a new one."""

import os
import tempfile

from jaxpaged.benchmarks import derived_folder


def test_a_file_is_keyed_by_its_content_not_its_mtime(tmp_path):
    first, copy, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in [(first, b"weights"), (copy, b"weights"), (other, b"weightz")]:
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(copy, ns=(1, 1))                     # a reinstall: same bytes, another mtime
    folder = derived_folder("kind", str(first), "-fp32")
    assert os.path.dirname(folder) == os.path.join(tempfile.gettempdir(), "kind")
    assert os.path.basename(folder).startswith("m.gguf-") and folder.endswith("-fp32")
    assert derived_folder("kind", str(copy), "-fp32") == folder
    assert derived_folder("kind", str(other), "-fp32") != folder


def test_a_folder_is_keyed_by_its_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    before = derived_folder("kind", str(tmp_path) + "/")
    assert os.path.basename(before).startswith(tmp_path.name + "-")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert derived_folder("kind", str(tmp_path)) != before
