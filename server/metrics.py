"""Prometheus exporter: the engine's counters and gauges plus per-request latency histograms.

Each app gets its own CollectorRegistry, so several servers (or tests) can run in one
process without clashing over metric names in the global registry.

With `vllm_names` (`jaxpaged serve --vllm-metric-names`) every metric that vLLM V1 also exports
is exported a second time under vLLM's name (VLLM_NAMES), so dashboards built for vLLM work
unchanged: same labels (`model_name`), same units, same histogram buckets.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpaged.outputs import RequestOutput

_LABELS = ["model_name"]
_HELP = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "num_requests_swapped": "Requests whose KV blocks are swapped out to host memory.",
    "num_preemptions_total": "Preemptions (recompute or swap) since start.",
    "prompt_tokens_total": "Prompt tokens of accepted requests.",
    "generation_tokens_total": "Generated tokens.",
    "request_success_total": "Requests that finished (stop or length).",
    "kv_cache_usage_perc": "Fraction of KV cache blocks held by requests (1 = full).",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Prompt tokens served from the prefix cache.",
    "external_prefix_cache_queries_total": "Prompt tokens looked up in the host-memory KV tier after a device miss.",
    "external_prefix_cache_hits_total": "Prompt tokens loaded from the host-memory KV tier instead of computed.",
    "swapped_out_blocks_total": "KV blocks swapped out to host memory.",
    "swapped_in_blocks_total": "KV blocks swapped back in to the device.",
    "spec_decode_num_drafts_total": "Speculative decoding: verifications (one request's drafts in one step).",
    "spec_decode_num_draft_tokens_total": "Speculative decoding: draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens_total": "Speculative decoding: draft tokens accepted.",
    "spec_decode_num_accepted_tokens_per_pos_total": "Speculative decoding: accepted draft tokens by position.",
}
# jaxpaged name -> vLLM V1's (counters without their _total, as prometheus_client adds it)
VLLM_NAMES = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "num_preemptions_total": "vllm:num_preemptions_total",
    "prompt_tokens_total": "vllm:prompt_tokens_total",
    "generation_tokens_total": "vllm:generation_tokens_total",
    "request_success_total": "vllm:request_success_total",
    "prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "external_prefix_cache_queries_total": "vllm:external_prefix_cache_queries_total",
    "external_prefix_cache_hits_total": "vllm:external_prefix_cache_hits_total",
    "spec_decode_num_drafts_total": "vllm:spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "request_prompt_tokens": "vllm:request_prompt_tokens",
    "request_generation_tokens": "vllm:request_generation_tokens",
}
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's scheme)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        scale *= 10


class _EngineCollector:
    """Reads `engine.get_metrics()` at scrape time; `_total` names are counters, the rest gauges."""

    def __init__(self, engine, model_name: str, vllm_names: bool = False):
        self.engine, self.model_name, self.vllm_names = engine, model_name, vllm_names

    def collect(self):
        per_rank = self.engine.get_metrics_per_rank()
        # one replica: labels [model_name]; data parallelism: one sample per replica, labelled
        # data_rank (sum by model_name for the whole server)
        labels = _LABELS if len(per_rank) == 1 else _LABELS + ["data_rank"]
        families: dict[str, list[tuple[str, dict[str, str]]]] = {}   # name -> (engine key, extra labels)
        for key in per_rank[0]:
            name, extra = _split_labels(key)
            families.setdefault(name, []).append((key, extra))
        for name, keys in families.items():
            short = name.split(":", 1)[-1]
            names = [name] + ([VLLM_NAMES[short]] if self.vllm_names and short in VLLM_NAMES else [])
            for exported in names:
                family = CounterMetricFamily if short.endswith("_total") else GaugeMetricFamily
                metric = family(exported, _HELP.get(short, short.replace("_", " ")),
                                labels=labels + list(keys[0][1]))
                for key, extra in keys:
                    for rank, metrics in enumerate(per_rank):
                        base = [self.model_name] if len(per_rank) == 1 else [self.model_name, str(rank)]
                        metric.add_metric(base + list(extra.values()), float(metrics[key]))
                yield metric


def _split_labels(key: str) -> tuple[str, dict[str, str]]:
    """'name{a="1",b="2"}' -> ('name', {'a': '1', 'b': '2'}); a key without braces has no labels."""
    if not key.endswith("}") or "{" not in key:
        return key, {}
    name, _, rest = key[:-1].partition("{")
    pairs = (item.split("=", 1) for item in rest.split(",") if item)
    return name, {k.strip(): v.strip().strip('"') for k, v in pairs}


class _Histograms:
    """One histogram under each exported name; observe() records into all."""

    def __init__(self, histograms):
        self.histograms = histograms

    def observe(self, value: float) -> None:
        for histogram in self.histograms:
            histogram.observe(value)


class MetricsExporter:
    def __init__(self, engine, model_name: str, vllm_names: bool = False):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name, vllm_names))

        def histogram(name: str, doc: str, buckets) -> _Histograms:
            names = ["jaxpaged:" + name] + ([VLLM_NAMES[name]] if vllm_names else [])
            return _Histograms([Histogram(n, doc, _LABELS, registry=self.registry, buckets=buckets).labels(model_name)
                                for n in names])

        tokens = _token_buckets(engine.max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, from arrival.", _TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _E2E_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.", tokens)

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished request (its `metrics` holds the AsyncLLM's timestamps)."""
        times = out.metrics
        completions = out.outputs if isinstance(out.outputs, list) else []   # a pooled prompt's: none
        num_generated = sum(len(c.token_ids) for c in completions)
        self.prompt_tokens.observe(out.num_prompt_tokens if isinstance(out, RequestOutput)
                                   else len(out.prompt_token_ids or ()))
        self.generation_tokens.observe(num_generated)
        if times is None or times.first_token_time is None or times.finished_time is None:
            return
        self.ttft.observe(times.first_token_time - times.arrival_time)
        self.e2e.observe(times.finished_time - times.arrival_time)
        # the sequences of n > 1 decode side by side, so the longest one sets the pace
        longest = max((len(c.token_ids) for c in completions), default=0)
        if longest > 1:
            self.tpot.observe((times.finished_time - times.first_token_time) / (longest - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
