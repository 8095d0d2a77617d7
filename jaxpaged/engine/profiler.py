"""vLLM's start_profile / stop_profile, on JAX's profiler: with `profiler_config={"profiler": "jax",
"profiler_dir": DIR}` (`--profiler-config`), `LLM.start_profile()` ... `LLM.stop_profile()` (AsyncLLM's,
between two engine steps; the server's POST /start_profile and /stop_profile) trace what ran in between:
the device's executables and kernels, the host's threads, and with `python_tracer` (the default) the
engine's Python calls. The trace lands under DIR/plugins/profile/<run>/: `<host>.xplane.pb` for TensorBoard or
XProf, and with `perfetto_trace` (the default) `perfetto_trace.json.gz` for https://ui.perfetto.dev.

JAX's profiler is one per process: one trace at a time, of every engine and thread in the process (all
data-parallel replicas); with several hosts, rank 0's process only.
"""

from __future__ import annotations

import dataclasses
import os

PROFILERS = ("jax",)


@dataclasses.dataclass(frozen=True)
class ProfilerConfig:
    profiler: str = "jax"
    profiler_dir: str = ""
    python_tracer: bool = True    # the host's Python calls in the trace (slower while tracing)
    perfetto_trace: bool = True   # also write a Perfetto trace (.trace.json.gz) when the trace stops

    def __post_init__(self) -> None:
        if self.profiler not in PROFILERS:
            raise ValueError(f"profiler_config.profiler must be one of {', '.join(map(repr, PROFILERS))}, "
                             f"got {self.profiler!r}")
        if not isinstance(self.profiler_dir, str) or not self.profiler_dir:
            raise ValueError(f"profiler_config.profiler_dir must be a folder for the traces, got {self.profiler_dir!r}")
        for name in ("python_tracer", "perfetto_trace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"profiler_config.{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, value) -> ProfilerConfig | None:
        """EngineArgs.profiler_config (None, a ProfilerConfig, a dict or its JSON) as a ProfilerConfig."""
        from jaxpaged.engine.arg_utils import json_config

        if value is None or isinstance(value, cls):
            return value
        return cls(**json_config("profiler_config", value, [f.name for f in dataclasses.fields(cls)]))


class Profiler:
    """The trace an engine front (LLM, AsyncLLM) starts and stops."""

    def __init__(self, config: ProfilerConfig | None):
        self.config = config
        self.tracing = False

    def start(self) -> None:
        import jax

        if self.config is None:
            raise ValueError("start_profile needs profiler_config={'profiler': 'jax', 'profiler_dir': DIR} "
                             "(--profiler-config) when the engine is made")
        if self.tracing:
            raise ValueError("start_profile: a trace is running already; call stop_profile first")
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 1 if self.config.python_tracer else 0
        os.makedirs(self.config.profiler_dir, exist_ok=True)
        jax.profiler.start_trace(self.config.profiler_dir, create_perfetto_trace=self.config.perfetto_trace,
                                 profiler_options=options)
        self.tracing = True

    def stop(self) -> None:
        import jax

        if not self.tracing:
            raise ValueError("stop_profile: no trace is running; call start_profile first")
        self.tracing = False
        jax.profiler.stop_trace()
