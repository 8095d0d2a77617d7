"""The benchmarks behind `jaxpaged bench throughput|serve|latency` (as vLLM keeps its own in vllm/benchmarks/); the
micro-benchmarks and the GPU check are repository tools, in the top-level benchmarks/ folder. Their figures:
README, "Results", and docs/results.md."""
import hashlib
import os
import tempfile


def derived_folder(kind: str, source: str, suffix: str = "") -> str:
    """Where a benchmark keeps what it makes once from `source` and reuses (a converted checkpoint):
    `<temp dir>/<kind>/<name>-<key><suffix>`. A file is keyed by its content (~0.1 s for the built-in
    model's 98 MB), so each reinstall of the same file (a new mtime) reuses the folder instead of
    leaving another on disk; a folder by its files' names, sizes and mtimes."""
    if os.path.isdir(source):
        stats = {entry.name: entry.stat() for entry in os.scandir(source) if entry.is_file()}
        entries = sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats.items())
        digest = hashlib.sha256(repr(entries).encode())
    else:
        with open(source, "rb") as f:
            digest = hashlib.file_digest(f, "sha256")
    name = os.path.basename(os.path.normpath(source))
    return os.path.join(tempfile.gettempdir(), kind, f"{name}-{digest.hexdigest()[:16]}{suffix}")
