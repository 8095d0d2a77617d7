"""The servers `jaxpaged bench serve` compares, as subprocesses on 127.0.0.1: jaxpaged's and
`transformers serve` on the same weights (dequantized once to an fp32 safetensors folder)."""

import os
import socket
import subprocess
import sys
import tempfile
import time

from jaxpaged.benchmarks import derived_folder


def load_tokenizer(model: str | None):
    from jaxpaged.models.builtin import builtin_model_path
    path = model or builtin_model_path()
    if path.endswith(".gguf"):
        from jaxpaged.models.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_model(base_url: str) -> str:
    import httpx
    return httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


class Subprocess:
    """A server on 127.0.0.1 until the `with` block ends (terminated, then killed if it lingers)."""

    def __init__(self, name: str, cmd: list[str], port: int, startup_timeout_s: float = 900.0):
        self.name, self.cmd, self.port, self.startup_timeout_s = name, cmd, port, startup_timeout_s
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Subprocess":
        import httpx

        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-serve-{self.name}-", suffix=".log", delete=False)
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        while time.perf_counter() - start < self.startup_timeout_s:
            if self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - start
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"{self.name} not healthy after {self.startup_timeout_s:.0f} s; log: {self.log.name}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def jaxpaged_command(model: str | None, port: int) -> list[str]:
    # fp32 weights, as transformers serve holds them (the default keeps the built-in GGUF quantized)
    cmd = [sys.executable, "-m", "jaxpaged.cli", "serve", "--dtype", "float32", "--quantization", "none",
           "--host", "127.0.0.1",
           "--port", str(port), "--uvicorn-log-level", "warning"]
    return cmd + (["--model", model] if model else [])


def export_transformers_folder(model: str | None) -> str:
    """The same weights jaxpaged runs, dequantized to fp32 safetensors with the tokenizer, in a folder
    `transformers serve` loads (it cannot serve the GGUF itself: the file's config names no
    architecture). Written once under the temp dir and reused."""
    from jaxpaged.benchmarks.throughput import builtin_hf_model
    from jaxpaged.models.builtin import builtin_model_path

    out = derived_folder("jaxpaged-bench-serve", model or builtin_model_path(), "-fp32")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    hf = builtin_hf_model("float32", model)
    hf.hf_quantizer = None   # dequantized already; save_pretrained refuses a model marked GGUF-quantized
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(out)
    load_tokenizer(model).save_pretrained(out)
    return out


def transformers_command(folder: str, port: int) -> list[str]:
    # the KV cache sized for this workload: by default it takes 90% of free memory (11 GB here)
    return [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", folder,
            "--continuous-batching", "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port), "--cb-num-blocks", "1024", "--cb-block-size", "64", "--log-level", "error"]
