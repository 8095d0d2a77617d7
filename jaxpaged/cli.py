"""Command line: `jaxpaged generate`, `jaxpaged serve`, `jaxpaged bench throughput|serve|latency|multiturn`."""

import argparse
import os
import sys

from jaxpaged.engine.arg_utils import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags with vLLM's names."""
    d = EngineArgs()
    parser.add_argument("--model", default=None, help="hub id, folder or .gguf (default: built-in SmolLM2)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--tokenizer-revision", default=None)
    parser.add_argument("--tokenizer-mode", default=d.tokenizer_mode, choices=["auto", "slow"])
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="load no tokenizer: prompts are token ids, outputs carry no text")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let a checkpoint's own config and tokenizer code run (transformers')")
    parser.add_argument("--hf-overrides", default=None, metavar="JSON",
                        help="fields of the checkpoint's config changed before loading, e.g. "
                             '\'{"max_position_embeddings": 8192}\'')
    parser.add_argument("--download-dir", default=None, help="where a hub id's files are downloaded (default: the "
                        "Hugging Face cache)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vLLM's flag, accepted: there are no CUDA graphs to skip, the step is XLA's programs")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
                        help="only 1: scale out with --tensor-parallel-size, --data-parallel-size, --num-nodes")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", "-q", default=d.quantization, type=lambda v: None if v == "none" else v,
                        help="auto (the checkpoint's own; a GGUF's blocks are de-quantized at load where float "
                             "weights take at most a quarter of the memory), gguf (keep them), none, int8, fp8, int4")
    parser.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                        help="auto: the checkpoint's weights; dummy: random weights of the config's shapes "
                             "(speed and memory runs without the weights)")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, help="auto, fp8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--calculate-kv-scales", action="store_true", help="fp8 KV scales from the first prompts")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--swap-space", type=float, default=d.swap_space)
    parser.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size,
                        help="GiB of host memory holding KV blocks the device's prefix cache evicts")
    parser.add_argument("--kv-offloading-backend", default=d.kv_offloading_backend, choices=["native"])
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    parser.add_argument("--logprobs-mode", default=d.logprobs_mode,
                        choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
                        help="what logprobs hold: the model's log-softmax (default) or logits, or those the token was "
                             "drawn from (after penalties, bias, temperature, min_p, top-k, top-p)")
    parser.add_argument("--attention-backend", default=d.attention_backend)
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=d.scan_layers,
                        help="lax.scan over stacked layer weights (compile time flat in depth) or an unrolled "
                             "layer loop (steps about as fast on XLA CPU, start-up twice as long); default: scan")
    parser.add_argument("--optimization-level", "-O", type=int, default=None, choices=[0, 1, 2, 3],
                        help="vLLM's -O0..-O3: 0 compiles the step fastest (XLA's code generation unoptimized), "
                             "2 (default) runs it fastest; 3 is 2")
    parser.add_argument("--generation-config", default=d.generation_config,
                        help="auto: sampling defaults and EOS ids from the model's generation_config.json; "
                             "vllm: ignore it; or a folder holding one")
    parser.add_argument("--preemption-mode", default=d.preemption_mode, choices=["auto", "recompute", "swap"])
    parser.add_argument("--runner", default=d.runner, choices=["auto", "generate", "pooling"],
                        help="pooling: the model embeds or classifies prompts (/v1/embeddings, /classify, "
                             "LLM.embed, LLM.classify) instead of generating; auto: pooling for a checkpoint "
                             "without an LM head")
    parser.add_argument("--pooler-config", default=None, metavar="JSON",
                        help='with --runner pooling: {"pooling_type": "LAST", "normalize": true} (default: the '
                             "checkpoint's sentence-transformers pooling, else this)")
    parser.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                        help="fcfs: requests in arrival order; priority: by each request's priority (the lower, "
                             "the sooner), then arrival; the running request of the lowest is preempted first")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                        help="schedule and prepare step t+1 while the device runs step t (default: on)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="devices each model replica is sharded over (Megatron-style)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                        help="model replicas, each with its own batch and KV cache")
    parser.add_argument("--distributed-coordinator", default=None, metavar="HOST:PORT",
                        help="several hosts: rank 0's address for jax.distributed (every host runs the same command)")
    parser.add_argument("--num-nodes", type=int, default=d.num_nodes, help="hosts running the engine together")
    parser.add_argument("--node-rank", type=int, default=d.node_rank,
                        help="this host's rank: 0 schedules and serves, the others run its steps")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             'or \'{"model": DRAFT, "num_speculative_tokens": 4}\'')
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    parser.add_argument("--enable-prompt-embeds", action="store_true",
                        help="prompts may be rows of input embeddings (/v1/completions' prompt_embeds: base64 of "
                             "torch.save(tensor) or a .npy file)")
    parser.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                        help='a prompt\'s most images, e.g. \'{"image": 2}\' (0: images refused)')
    parser.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                        help='the image processor\'s overrides, e.g. \'{"max_pixels": 1003520}\' (Qwen2-VL)')
    parser.add_argument("--enable-mm-embeds", action="store_true",
                        help="multi_modal_data's images may be the rows of the vision tower's output "
                             "({'image_embeds': array}; chat's image_embeds parts)")
    parser.add_argument("--logits-processors", nargs="+", default=None, metavar="MODULE:CLASS",
                        help="custom logits processors (jaxpaged.LogitsProcessor subclasses), applied in order; "
                             "requests pass them arguments in vllm_xargs")
    parser.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="the folder file:// image URLs may be read from (default: file:// refused)")
    parser.add_argument("--max-loras", type=int, default=d.max_loras, help="adapters in one batch (default 1)")
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="the largest adapter rank")
    parser.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory")
    from jaxpaged.reasoning import REASONING_PARSERS
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="a thinking model's <think> ... </think>: the server's chat answers carry it as "
                             "`reasoning` (and `reasoning_content`), and structured outputs constrain what "
                             "follows it: deepseek_r1 (R1 and its distills, QwQ), qwen3, ...; openai_gptoss "
                             "(harmony's channels) is gpt-oss' default")
    parser.add_argument("--profiler-config", default=None, metavar="JSON",
                        help='{"profiler": "jax", "profiler_dir": DIR}: the server gets POST /start_profile and '
                             "/stop_profile, which trace the engine with JAX's profiler into DIR")


def engine_kwargs(ns: argparse.Namespace) -> dict:
    keys = set(EngineArgs.__dataclass_fields__) - {"model"}
    return {k: v for k, v in vars(ns).items() if k in keys}


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxpaged import LLM, SamplingParams

    llm = LLM(ns.model, compile_on_startup=False, **engine_kwargs(ns))
    if llm.is_follower:   # several hosts: this one ran rank 0's steps; rank 0 prints the outputs
        return 0
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.seed)
    tokenizer = llm.get_tokenizer()
    use_chat = not ns.no_chat_template and getattr(tokenizer, "chat_template", None)
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(ns.prompt, params, use_tqdm=False)
    for prompt, out in zip(ns.prompt, outputs):
        print(f"Prompt: {prompt!r}\nOutput: {out.outputs[0].text}\n")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"MODEL ({ns.model_tag!r}) and --model ({ns.model!r}) disagree; give one of them")
    names = ns.served_model_name
    kwargs = {**engine_kwargs(ns), "served_model_name": names[0] if names else None}
    args = EngineArgs(model=ns.model_tag or ns.model, compile_on_startup=True, **kwargs)
    from jaxpaged import server
    return server.run_server(args, host=ns.host, port=ns.port, api_key=ns.api_key, served_model_names=names,
                             log_level=ns.uvicorn_log_level, enable_auto_tool_choice=ns.enable_auto_tool_choice,
                             tool_call_parser=ns.tool_call_parser, chat_template=ns.chat_template,
                             vllm_metric_names=ns.vllm_metric_names, max_num_waiting=ns.max_num_waiting,
                             shutdown_timeout=ns.shutdown_timeout, enable_sleep_mode=ns.enable_sleep_mode,
                             lora_modules=ns.lora_modules, max_request_body_bytes=ns.max_request_body_bytes)


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="hub id, folder or .gguf (default: built-in SmolLM2); same as --model")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXPAGED_API_KEY)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use as `model`; the first is reported (default: the model)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    from jaxpaged.tool_parsers import TOOL_PARSERS
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser')
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, to use instead of the tokenizer's")
    serve.add_argument("--vllm-metric-names", action="store_true",
                       help="/metrics also exports vLLM's names (vllm:num_requests_running, ...) for its dashboards")
    serve.add_argument("--max-num-waiting", type=int, default=None,
                       help="refuse new requests with a 503 (Retry-After) while this many wait for a seat in the "
                            "batch (default: queue without bound)")
    serve.add_argument("--max-request-body-bytes", type=int, default=None,
                       help="refuse a request body above this many bytes with a 413, unread (default: max(1 MiB, "
                            "32 bytes a token of --max-model-len), room for a whole context several times over)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds that streams in flight get to finish after Ctrl-C or SIGTERM (default 10)")
    serve.add_argument("--enable-sleep-mode", action="store_true",
                       help="POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's dev routes)")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served by name (needs --enable-lora): name=path, or JSON "
                            '\'{"name": ..., "path": ...}\'; /v1/load_lora_adapter adds more')
    serve.set_defaults(func=cmd_serve)


def main(argv: list[str] | None = None) -> int:
    # transformers announces at import that torch is missing; the run time never needs it
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = argparse.ArgumentParser(prog="jaxpaged", description="JAX LLM inference with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    gen.set_defaults(func=cmd_generate)
    add_serve_parser(sub)
    conv = sub.add_parser("convert", help="write a model's weights as an orbax-checkpoint folder (restored "
                                          "straight into any tensor-parallel layout)")
    conv.add_argument("model", metavar="MODEL", help="hub id, folder or .gguf (builtin: the built-in SmolLM2)")
    conv.add_argument("out", metavar="OUT", help="folder to create (must not exist or be empty)")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    conv.add_argument("--revision", default=None)
    conv.set_defaults(func=cmd_convert)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput vs transformers (see benchmarks/)")
    tp.add_argument("args", nargs=argparse.REMAINDER)
    tp.set_defaults(func=lambda ns: _bench_throughput(ns.args))
    sv = bench_sub.add_parser("serve", help="a running server under 1-256 concurrent streams vs transformers serve")
    sv.add_argument("args", nargs=argparse.REMAINDER)
    sv.set_defaults(func=lambda ns: _bench_serve(ns.args))
    lat = bench_sub.add_parser("latency", help="the host's work per decode step at two batch sizes, phase by phase")
    lat.add_argument("args", nargs=argparse.REMAINDER)
    lat.set_defaults(func=lambda ns: _bench_latency(ns.args))
    mt = bench_sub.add_parser("multiturn", help="multi-turn chat over a small KV pool, with the host tier and without")
    mt.add_argument("args", nargs=argparse.REMAINDER)
    mt.set_defaults(func=lambda ns: _bench_multiturn(ns.args))
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "throughput"]:   # its own parser takes every option (REMAINDER stops at "--x")
        return _bench_throughput(argv[2:])
    if argv[:2] == ["bench", "serve"]:
        return _bench_serve(argv[2:])
    if argv[:2] == ["bench", "latency"]:
        return _bench_latency(argv[2:])
    if argv[:2] == ["bench", "multiturn"]:
        return _bench_multiturn(argv[2:])
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_convert(ns: argparse.Namespace) -> int:
    import time

    from jaxpaged.models.loader import convert_checkpoint
    model = ns.model
    if model == "builtin":
        from jaxpaged.models.builtin import builtin_model_path
        model = builtin_model_path()
    start = time.perf_counter()
    convert_checkpoint(model, ns.out, ns.dtype, ns.revision)
    print(f"wrote {ns.out} in {time.perf_counter() - start:.1f} s; serve it with: jaxpaged serve {ns.out}")
    return 0


def _bench_throughput(args: list[str]) -> int:
    from jaxpaged.benchmarks.throughput import main as bench_main
    return bench_main(args)


def _bench_serve(args: list[str]) -> int:
    from jaxpaged.benchmarks.serve import main as bench_main
    return bench_main(args)


def _bench_latency(args: list[str]) -> int:
    from jaxpaged.benchmarks.latency import main as bench_main
    return bench_main(args)


def _bench_multiturn(args: list[str]) -> int:
    from jaxpaged.benchmarks.multiturn import main as bench_main
    return bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
