"""Serving under load: jaxpaged's server and `transformers serve` driven by the same client.

The client is the official `openai` async client, with vLLM's benchmark_serving conventions:
streaming /v1/completions with usage in the last chunk, each event's line parsed with json.loads;
per request the time it was sent, its first content chunk (TTFT), each later chunk (inter-token
latency: the gaps between chunks after the first) and its last (end to end); output tokens from
the usage; request throughput = completed requests / wall time of the level, whose clock starts
after the client's first request (a model listing: its own set-up is not the server's time). At
each concurrency c, c workers send requests back to back until the level's requests are used up.

Workload: `throughput.make_workload`'s ShareGPT shape (prompts of 8-128 random token ids, outputs
about twice as long), the prompts decoded to text (transformers serve takes text prompts only),
outputs capped so that every level fits in minutes on a 2-core CPU (the caps are printed). Both
servers produce exactly max_tokens: jaxpaged through vLLM's `ignore_eos`; transformers serve
refuses that field (422), so it gets a `generation_config` without an EOS id (EOS disabled).

    python -m jaxpaged.benchmarks.serve [--concurrency 1 16 64 256] [--num-requests N]
        [--skip-transformers] [--model M] [--port P] [--url URL]

Each server runs as a subprocess on 127.0.0.1, one at a time, and is stopped afterwards. `--url`
drives a server that is already running instead. Then the offline engine (`jaxpaged.LLM`, the
server's engine arguments) times its decode step at a batch of 64, next to the server's mean ITL
at 64 streams.
"""

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.benchmarks.serve_processes import (Subprocess, export_transformers_folder, free_port, jaxpaged_command,
                                                 load_tokenizer, served_model, transformers_command)
from jaxpaged.benchmarks.throughput import StepClock, make_workload

OUTPUT_CAPS = {1: 64, 16: 64, 64: 64, 256: 16}   # streams -> max output tokens (256: short, to stay affordable)
REQUEST_COUNTS = {1: 2, 16: 16, 64: 64, 256: 256}   # streams -> requests sent (--num-requests overrides)
OFFLINE_BATCH = 64


@dataclass
class RequestRecord:
    """What the client saw of one request; times are time.perf_counter() seconds."""
    sent: float
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk with content
    output_tokens: int = 0    # from the usage in the last chunk
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))


@dataclass
class Server:
    """How to ask one server for exactly `max_tokens` greedy tokens."""
    name: str
    base_url: str   # http://127.0.0.1:PORT
    model: str
    extra_body: Callable[[int], dict]   # max_tokens -> the request fields that make it produce exactly that many


def jaxpaged_body(max_tokens: int) -> dict:
    return {"ignore_eos": True}


def transformers_body(max_tokens: int) -> dict:
    # a generation_config replaces the model's; without eos_token_id the CB manager disables EOS
    return {"generation_config": json.dumps({"max_new_tokens": max_tokens, "do_sample": False})}


async def send_one(client, server: Server, prompt: str | list[int], max_tokens: int) -> RequestRecord:
    """One streaming request. The client's raw response is read line by line and each event parsed
    with json.loads, as vLLM's benchmark_serving does: the openai client's own stream builds a pydantic
    object per chunk, which on this 2-core machine took ~30% more of the client's CPU (1.37 against
    1.04 s over the 64-stream level), time taken from the server it measures."""
    record = RequestRecord(time.perf_counter())
    try:
        async with client.completions.with_streaming_response.create(
                model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body=server.extra_body(max_tokens)) as response:
            async for line in response.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):   # an error event mid-stream (the openai client raises on one too)
                    raise RuntimeError(f"error event: {chunk['error']}")
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    record.chunk_times.append(time.perf_counter())
                usage = chunk.get("usage")
                if usage:
                    record.output_tokens, record.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
        if not record.chunk_times or record.output_tokens == 0:
            record.error = "no content or no usage in the stream"
    except Exception as exc:   # a failed request is reported, not fatal to the level
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_level(server: Server, work: list[tuple[str | list[int], int]], concurrency: int,
                    timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send `work` with `concurrency` requests in flight; returns the records of the requests that
    ended (in any way) before `timeout_s` and the level's wall time."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4),
                                                              timeout=timeout_s))
    # The client's own first-use costs stay out of the level (vLLM's benchmark_serving sends a test prompt
    # first for the same reason): httpcore imports its concurrency backend lazily on its first connection,
    # ~0.23 s on a 2-core CPU that would delay every request of the 64-stream level. A model listing touches no
    # engine and no cache; whatever it answers, the client is warm.
    try:
        await client.models.list()
    except openai.APIError:
        pass
    queue = list(reversed(work))
    records: list[RequestRecord] = []

    async def worker():
        while queue:
            prompt, max_tokens = queue.pop()
            records.append(await send_one(client, server, prompt, max_tokens))

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    await client.close()
    return records, wall


@dataclass
class LevelResult:
    server: str
    concurrency: int
    sent: int
    completed: int
    failed: int
    wall_s: float
    output_tokens: int
    request_throughput: float   # completed / wall
    output_throughput: float    # output tokens / wall
    ttft_ms: tuple[float, float]   # (p50, p99)
    itl_ms: tuple[float, float]
    e2e_s: tuple[float, float]
    mean_itl_ms: float
    first_error: str | None


def summarize(server: str, concurrency: int, sent: int, records: list[RequestRecord], wall: float) -> LevelResult:
    done = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    itls = [gap for r in done for gap in r.itls]

    def pct(values, scale):
        if not values:
            return (float("nan"), float("nan"))
        return tuple(float(np.percentile(values, q)) * scale for q in (50, 99))

    tokens = sum(r.output_tokens for r in done)
    return LevelResult(server, concurrency, sent, len(done), len(failed), wall, tokens, len(done) / wall,
                       tokens / wall, pct([r.ttft for r in done], 1e3), pct(itls, 1e3),
                       pct([r.e2e for r in done], 1.0), 1e3 * float(np.mean(itls)) if itls else float("nan"),
                       failed[0].error if failed else None)


HEADER = (f"{'server':30s} {'streams':>7s} {'done/sent':>9s} {'out cap':>7s} {'req/s':>6s} {'out tok/s':>9s} "
          f"{'TTFT p50/p99 ms':>17s} {'ITL p50/p99 ms':>15s} {'E2E p50/p99 s':>14s} {'ITL mean':>8s}")


def format_row(r: LevelResult, cap: int) -> str:
    return (f"{r.server:30s} {r.concurrency:7d} {f'{r.completed}/{r.sent}':>9s} {cap:7d} "
            f"{r.request_throughput:6.2f} {r.output_throughput:9.1f} "
            f"{f'{r.ttft_ms[0]:.0f}/{r.ttft_ms[1]:.0f}':>17s} {f'{r.itl_ms[0]:.0f}/{r.itl_ms[1]:.0f}':>15s} "
            f"{f'{r.e2e_s[0]:.1f}/{r.e2e_s[1]:.1f}':>14s} {r.mean_itl_ms:8.1f}")


def level_work(prompts: list[str | list[int]], lengths: list[int], count: int, cap: int, start: int = 0):
    """`count` requests of the workload from `start` (wrapping if it is shorter), outputs capped at `cap`.
    Each level gets requests of its own, so no level is served from another's prefix cache."""
    return [(prompts[i % len(prompts)], min(lengths[i % len(lengths)], cap)) for i in range(start, start + count)]


def level_starts(concurrencies, counts) -> dict[int, int]:
    """Where each level's requests start in the workload (levels run in the order given)."""
    starts, start = {}, 0
    for c in concurrencies:
        starts[c] = start
        start += counts(c)
    return starts


def text_workload(model: str | None, count: int, seed: int = 0) -> tuple[list[str], list[int]]:
    tokenizer = load_tokenizer(model)
    work = make_workload(count, len(tokenizer), seed)
    return [tokenizer.decode(ids) for ids, _ in work], [n for _, n in work]


# ---- the offline engine's decode step ------------------------------------------------------
def offline_step_ms(model: str | None, prompts: list[str], work: list[tuple[str, int]],
                    batch: int = OFFLINE_BATCH, steps: int = 32) -> list[tuple[str, str, float]]:
    """The offline engine (the server's engine arguments), two ways; each (what, summary, ms):
    `work` (the 64-stream level's requests, all added at once as the server got them) stepped by
    hand, its inter-token latency measured as the server's is (the gaps between a request's
    outputs after its first), so prefill steps that stall decoding count the same on both sides;
    and `batch` sequences all decoding, the mean of `steps` steps after every prompt was prefilled."""
    from jaxpaged import LLM, RequestOutputKind, SamplingParams

    llm = LLM(model, dtype="float32", quantization=None, use_tqdm=False, compile_on_startup=True)
    engine = llm.llm_engine
    out = []
    clock = StepClock(engine.replicas()[0].runner)
    arrivals: dict[str, list[float]] = {}
    start = time.perf_counter()
    for prompt, n in work:
        request_id = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                                     output_kind=RequestOutputKind.DELTA))
        arrivals[request_id] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.outputs and o.outputs[0].token_ids:
                arrivals[o.request_id].append(time.perf_counter())
    elapsed = time.perf_counter() - start
    engine.replicas()[0].runner.dispatch, engine.replicas()[0].runner.fetch = clock.originals
    gaps = [g for times in arrivals.values() for g in np.diff(times)]
    out.append((f"the 64-stream level's {len(work)} requests, mean inter-token latency",
                clock.summary(elapsed), 1e3 * float(np.mean(gaps))))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    ids = [engine.add_request(None, prompts[i % len(prompts)], params) for i in range(batch)]
    started: set[str] = set()
    while len(started) < batch:   # prefill (chunked) until every sequence has its first token
        started |= {out.request_id for out in engine.step() if out.outputs and out.outputs[0].token_ids}
    engine.step()   # one more step so the next `steps` are all full decode batches
    clock = StepClock(engine.replicas()[0].runner)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for request_id in ids:
        engine.abort_request(request_id)
    llm.shutdown()
    out.append((f"{batch} sequences all decoding, mean step", clock.summary(elapsed), 1e3 * elapsed / steps))
    return out


def run_server_levels(name: str, server: Server, concurrencies, prompts, lengths, counts, timeout_s) -> list:
    rows = []
    starts = level_starts(concurrencies, counts)
    for c in concurrencies:
        cap = OUTPUT_CAPS.get(c, 64)
        work = level_work(prompts, lengths, counts(c), cap, starts[c])
        records, wall = asyncio.run(run_level(server, work, c, timeout_s))
        result = summarize(name, c, len(work), records, wall)
        rows.append((result, cap))
        print(format_row(result, cap) + (f"  first error: {result.first_error}" if result.first_error else ""),
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests per level (default by streams: {REQUEST_COUNTS}, else max(streams, 8))")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-offline", action="store_true", help="no offline step timing")
    parser.add_argument("--model", default=None, help="a folder or .gguf (default: the built-in SmolLM2)")
    parser.add_argument("--port", type=int, default=None, help="jaxpaged's port (default: a free one)")
    parser.add_argument("--url", default=None, help="drive this running server (e.g. http://127.0.0.1:8000) "
                                                    "with ignore_eos; starts no server, no transformers")
    parser.add_argument("--level-timeout", type=float, default=180.0,
                        help="seconds a level may take; requests still running then are dropped (default 180)")
    ns = parser.parse_args(argv)
    for c in ns.concurrency:
        if c < 1:
            raise ValueError(f"--concurrency values must be >= 1, got {c}")

    def counts(c: int) -> int:
        return ns.num_requests or REQUEST_COUNTS.get(c, max(c, 8))

    prompts, lengths = text_workload(ns.model, sum(counts(c) for c in ns.concurrency))
    print(f"workload: ShareGPT-shaped synthetic (make_workload, seed 0), text prompts of 8-128 random tokens; "
          f"requests per level {[counts(c) for c in ns.concurrency]}; output caps {OUTPUT_CAPS}; greedy, "
          f"exactly max_tokens; streaming /v1/completions; client: openai.AsyncOpenAI, raw lines + json.loads",
          flush=True)
    print(HEADER, flush=True)
    rows = []
    if ns.url:
        url = ns.url.rstrip("/")
        server = Server("server at " + url, url, served_model(url), jaxpaged_body)
        rows += run_server_levels(server.name, server, ns.concurrency, prompts, lengths, counts, ns.level_timeout)
    else:
        port = ns.port or free_port()
        with Subprocess("jaxpaged", jaxpaged_command(ns.model, port), port) as proc:
            server = Server("jaxpaged, fp32, defaults", proc.base_url, served_model(proc.base_url), jaxpaged_body)
            rows += run_server_levels(server.name, server, ns.concurrency, prompts, lengths, counts,
                                      ns.level_timeout)
        if not ns.skip_transformers:
            folder = export_transformers_folder(ns.model)
            port = free_port()
            with Subprocess("transformers", transformers_command(folder, port), port) as proc:
                server = Server("transformers serve, fp32, CB", proc.base_url, served_model(proc.base_url),
                                transformers_body)
                rows += run_server_levels(server.name, server, ns.concurrency, prompts, lengths, counts,
                                          ns.level_timeout)
    report(rows, ns, prompts, lengths, counts)
    return 0


def report(rows, ns, prompts, lengths, counts) -> None:
    """The goals at 64 streams: against transformers serve, and against the offline step."""
    at_64 = {r.server.split(",")[0]: r for r, _ in rows if r.concurrency == 64}
    ours = next((r for name, r in at_64.items() if not name.startswith("transformers")), None)
    theirs = at_64.get("transformers serve")
    if ours and theirs and theirs.output_throughput > 0:
        print(f"at 64 streams: output tok/s {ours.output_throughput / theirs.output_throughput:.2f}x transformers "
              f"serve's (goal >= 4x); TTFT p99 {ours.ttft_ms[1]:.0f} ms against {theirs.ttft_ms[1]:.0f} ms "
              f"(goal: lower)", flush=True)
    if ours and not ns.skip_offline and not ns.url:
        work = level_work(prompts, lengths, counts(64), OUTPUT_CAPS[64], level_starts(ns.concurrency, counts)[64])
        for what, summary, ms in offline_step_ms(ns.model, prompts, work):
            print(f"offline engine, {what}: {ms:.1f} ms ({summary})")
            print(f"server mean ITL at 64 streams {ours.mean_itl_ms:.1f} ms = {ours.mean_itl_ms / ms:.2f}x that "
                  f"(goal: within 15%)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
