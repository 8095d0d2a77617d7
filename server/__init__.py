"""The OpenAI-compatible HTTP server: `jaxpaged serve` or `python -m jaxpaged.server`.

`build_app(engine)` gives the Starlette app for an AsyncLLM (tests start it on a port of
their own); `run_server` loads the model, warms the step's shape buckets, logs what it
serves and runs uvicorn (`serve`) until interrupted.

How it ends: Ctrl-C or SIGTERM stops accepting connections, gives the streams in flight
`shutdown_timeout` seconds to finish, aborts the rest and exits 0; an engine loop that dies
turns /health to 503 at once and the process exits 1 (for a supervisor to restart it).
"""

import logging
import signal
import threading

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.server.app import build_app
from jaxpaged.server.tools import ToolSettings

__all__ = ["build_app", "run_server", "serve"]

logger = logging.getLogger("jaxpaged.server")


def run_server(args: EngineArgs, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_names: list[str] | None = None, log_level: str = "info",
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
               chat_template: str | None = None, vllm_metric_names: bool = False,
               max_num_waiting: int | None = None, shutdown_timeout: float = 10.0,
               enable_sleep_mode: bool = False, lora_modules: list[str] | None = None,
               max_request_body_bytes: int | None = None) -> int:
    """Serve `args`' model until interrupted; returns the exit status. `chat_template`: a Jinja
    template, or the path of a file holding one, instead of the tokenizer's; `max_num_waiting`:
    new requests get a 503 (Retry-After) while this many wait for a seat in the batch;
    `lora_modules`: adapters served by name ("name=path" or JSON, see parse_lora_modules);
    `max_request_body_bytes`: larger request bodies get a 413 unread (None: max(1 MiB, 32 bytes
    a token of max_model_len), see server/json_body.py)."""
    import os

    import uvicorn

    from jaxpaged import AsyncLLM

    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout!r}")
    if max_request_body_bytes is not None and max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
    tool_settings = ToolSettings(enable_auto_tool_choice, tool_call_parser)   # checked before the model loads
    adapters = parse_lora_modules(lora_modules)
    if adapters and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    if args.num_nodes > 1 and args.node_rank != 0:   # the server runs on rank 0; this host runs its steps
        from jaxpaged.engine.dp_engine import make_engine
        make_engine(args).follow()
        return 0
    engine = AsyncLLM.from_engine_args(args, max_num_waiting=max_num_waiting)
    try:
        import asyncio
        for adapter in adapters:   # each folder read now: a bad one stops the start with its ValueError
            asyncio.run(engine.add_lora(adapter))
        app = build_app(engine, served_model_names, api_key, tool_settings, chat_template, vllm_metric_names,
                        enable_sleep_mode, adapters if args.enable_lora else None, max_request_body_bytes)
        names = app.state.server.names
        usable = engine.num_blocks - 1   # block 0 is the null block padded block tables point at
        logger.info("model: %s (served as %s), max_model_len %d", args.model or engine.model_name,
                    ", ".join(names), engine.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens", usable, engine.block_size,
                    usable * engine.block_size)
        shown = "localhost" if host in ("0.0.0.0", "::") else host
        logger.info("serving on http://%s:%d (OpenAI API at http://%s:%d/v1%s)", shown, port, shown, port,
                    ", API key required" if api_key else "")
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=shutdown_timeout)
        return serve(uvicorn.Server(config), engine)
    finally:
        engine.shutdown()


def parse_lora_modules(modules: list[str] | None) -> list:
    """--lora-modules entries, "name=path" or JSON {"name": ..., "path": ...}, as LoRARequests
    numbered 1, 2, ... in order. ValueError naming the entry when one is malformed."""
    import json

    from jaxpaged.lora import LoRARequest

    out = []
    for i, entry in enumerate(modules or [], start=1):
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {entry!r}: JSON entries need 'name' and 'path'") from None
        else:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {entry!r}: expected name=path or JSON with 'name' and 'path'")
        if any(r.lora_name == name for r in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append(LoRARequest(name, i, path))
    return out


def serve(server, engine, poll_s: float = 0.1) -> int:
    """Run the uvicorn `server` until a signal or the engine loop's death; returns the exit status
    (0 after Ctrl-C or SIGTERM, 1 when the engine loop died). The app has no startup/shutdown
    hooks: the engine's lifetime is the caller's."""
    died, finished = threading.Event(), threading.Event()

    def watch():   # until uvicorn returns: a death while streams drain after SIGTERM still counts
        while not finished.wait(poll_s):
            if not engine.is_running:
                logging.getLogger("jaxpaged.server").error("the engine loop is not running: shutting the server down")
                died.set()
                server.should_exit = True
                return

    watchdog = threading.Thread(target=watch, name="jaxpaged-watchdog", daemon=True)
    watchdog.start()
    # uvicorn re-raises the signal that stopped it once it is done; a handler of ours makes that a
    # plain return (exit 0) instead of a death by SIGTERM
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        server.run()
    except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        finished.set()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 1 if died.is_set() or not engine.is_running else 0
