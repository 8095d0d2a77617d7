"""Compiled steps kept on disk whole, so a warm start-up skips tracing and lowering too.

JAX's persistent compilation cache saves XLA's compile, but finding an entry still traces
and lowers the step (about 1 s per variant for the built-in model: most of a warm start-up
with 35 variants). Here the compiled executable itself is serialized
(`jax.experimental.serialize_executable`) under a key of everything that decides it: the
engine's source files, jax and jaxlib versions, the backend and device, XLA_FLAGS, the step's
static arguments (model graph, bucket, block size, logprobs width) and the shapes, dtypes and
shardings of its inputs. Loading one takes ~0.1 s. Any change to the engine's code gives new
keys; entries are never reused across versions.

The folder is `<jax compilation cache dir>/jaxpaged-steps`, so `JAXPAGED_COMPILATION_CACHE=0`
(no compilation cache) turns this off too.
"""

import functools
import hashlib
import logging
import os
import pickle
import tempfile

import jax
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

_PACKAGES = ("jaxpaged", "pallas_kernels")


@functools.cache
def source_digest() -> str:
    """sha256 of every Python file of the engine and its kernels (computed once per process)."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for package in _PACKAGES:
        for folder, dirs, files in sorted(os.walk(os.path.join(root, package))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _folder() -> str | None:
    base = jax.config.jax_compilation_cache_dir
    return os.path.join(base, "jaxpaged-steps") if base else None


def executable_key(static, args) -> str:
    """A key naming everything the compiled step depends on."""
    import jaxlib
    device = jax.devices()[0]
    leaves, treedef = jax.tree.flatten(args)
    avals = [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]
    parts = (source_digest(), jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
             getattr(device.client, "platform_version", ""), os.environ.get("XLA_FLAGS", ""), repr(static),
             str(treedef), avals)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def load(key: str):
    """The compiled executable stored under `key`, or None (absent, or unreadable: then recompiled)."""
    folder = _folder()
    if folder is None:
        return None
    path = os.path.join(folder, key)
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception as exc:   # a stale or broken entry costs a compile, never a failure
        logger.warning("ignoring the cached step %s (%s: %s)", path, type(exc).__name__, exc)
        return None


def store(key: str, compiled) -> None:
    """Save a compiled executable under `key` (atomically; errors only logged)."""
    folder = _folder()
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        blob = pickle.dumps(serialize_executable.serialize(compiled))
        fd, staging = tempfile.mkstemp(dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(staging, os.path.join(folder, key))
    except Exception as exc:   # a read-only or full disk must not stop the engine
        logger.warning("could not save a compiled step in %s (%s: %s)", folder, type(exc).__name__, exc)
