"""The Prometheus exporter without a server: the engine's gauges and counters and the request
histograms, under jaxpaged's names and, with vllm_names, under vLLM's too."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.engine.async_llm import RequestMetrics
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.server.metrics import VLLM_NAMES, MetricsExporter


class FakeEngine:
    max_model_len = 256

    def get_metrics_per_rank(self):
        return [{"jaxpaged:num_requests_running": 3, "jaxpaged:kv_cache_usage_perc": 0.25,
                 "jaxpaged:num_preemptions_total": 2, "jaxpaged:swapped_in_blocks_total": 5}]


def scrape(exporter) -> dict[str, float]:
    body, _ = exporter.render()
    return {(sample.name, sample.labels.get("le")): sample.value
            for family in text_string_to_metric_families(body.decode()) for sample in family.samples
            if not sample.name.endswith("_created")}   # creation times differ by microseconds


def finished_request() -> RequestOutput:
    out = RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(0, "ab", [5, 6, 7], None, None, "stop")], True)
    out.metrics = RequestMetrics(arrival_time=100.0, first_token_time=100.5, finished_time=101.5)
    return out


@pytest.mark.parametrize("vllm_names", [False, True])
def test_vllm_names_repeat_the_same_values(vllm_names):
    exporter = MetricsExporter(FakeEngine(), "m", vllm_names=vllm_names)
    exporter.observe_finished(finished_request())
    values = scrape(exporter)
    assert values[("jaxpaged:num_requests_running", None)] == 3
    assert values[("jaxpaged:time_to_first_token_seconds_sum", None)] == 0.5
    vllm = {name: value for name, value in values.items() if name[0].startswith("vllm:")}
    if not vllm_names:
        assert not vllm
        return
    assert vllm[("vllm:num_requests_running", None)] == 3 and vllm[("vllm:kv_cache_usage_perc", None)] == 0.25
    assert vllm[("vllm:num_preemptions_total", None)] == 2
    assert not any("swapped" in name for name, _ in vllm)   # vLLM V1 has no such counter
    for short in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_generation_tokens"):
        ours = {le: v for (name, le), v in values.items() if name.startswith(f"jaxpaged:{short}")}
        theirs = {le: v for (name, le), v in values.items() if name.startswith(VLLM_NAMES[short])}
        assert ours == theirs and ours
    assert vllm[("vllm:time_per_output_token_seconds_sum", None)] == 0.5   # (101.5 - 100.5) / (3 - 1)


class SpecEngine(FakeEngine):
    def get_metrics_per_rank(self):
        return [{"jaxpaged:spec_decode_num_drafts_total": 4, "jaxpaged:spec_decode_num_accepted_tokens_total": 5,
                 'jaxpaged:spec_decode_num_accepted_tokens_per_pos_total{position="0"}': 3,
                 'jaxpaged:spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 2}]


def test_speculative_decoding_counters_carry_their_position_label():
    body, _ = MetricsExporter(SpecEngine(), "m", vllm_names=True).render()
    samples = {(s.name, s.labels.get("position")): (s.value, s.labels["model_name"])
               for family in text_string_to_metric_families(body.decode()) for s in family.samples
               if not s.name.endswith("_created")}
    for prefix in ("jaxpaged:", "vllm:"):
        assert samples[(prefix + "spec_decode_num_accepted_tokens_per_pos_total", "0")] == (3, "m")
        assert samples[(prefix + "spec_decode_num_accepted_tokens_per_pos_total", "1")] == (2, "m")
        assert samples[(prefix + "spec_decode_num_drafts_total", None)] == (4, "m")
