"""Nothing outside the tests imports torch: the runtime install has none (torch is test-only).

Each check runs in a fresh interpreter where `import torch` fails, as on a runtime-only install.
"""

import subprocess
import sys
import textwrap

from tests.tiny_models import tiny_checkpoint

_BLOCK_TORCH = textwrap.dedent("""
    import sys
    # as if torch were not installed: `import torch` raises ModuleNotFoundError and
    # importlib.util.find_spec("torch") (transformers' availability check) returns None
    sys.modules["torch"] = None
""")


def run_without_torch(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_the_engine_server_and_cli_run_without_torch():
    path = tiny_checkpoint("llama")   # written here, with torch; read there, without
    out = run_without_torch(f"""
        import jaxpaged, jaxpaged.cli, server.app
        from jaxpaged import LLM, SamplingParams
        llm = LLM({path!r}, dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
                  compile_on_startup=False)
        out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        assert sys.modules.get("torch") is None
        print("ok", out.outputs[0].token_ids)
    """)
    assert out.startswith("ok")
