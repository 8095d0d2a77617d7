"""What an install puts on the import path: one package, jaxpaged, with the server and the kernels inside."""

import os
import subprocess
import sys


def test_the_server_and_the_kernels_install_under_jaxpaged_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the installed package, not the checkout
    code = ("import importlib.util as u\n"
            "assert u.find_spec('server') is None and u.find_spec('pallas_kernels') is None\n"
            "from jaxpaged.server import build_app\n"
            "from jaxpaged.kernels import AttentionMetadata\n"
            "from jaxpaged.kernels.backends import AttentionFn\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
