"""The engine's counters and gauges, as plain numbers (the server exports them to Prometheus)."""

import dataclasses

PREFIX = "jaxpaged:"


@dataclasses.dataclass
class EngineMetrics:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    swapped_out_blocks_total: int = 0
    swapped_in_blocks_total: int = 0

    def snapshot(self, scheduler, kv_cache, output_processor) -> dict[str, float]:
        """Counters and gauges, names prefixed `jaxpaged:`. The output side counts finished requests and
        the tokens it took back (sampled after a stop string: generated, never returned)."""
        values = {
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
            "num_requests_swapped": len(getattr(scheduler, "swapped", ())),
            "num_preemptions_total": self.num_preemptions_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total - output_processor.num_dropped_tokens,
            "request_success_total": output_processor.num_finished,
            "kv_cache_usage_perc": kv_cache.usage(),
            "prefix_cache_queries_total": kv_cache.prefix_queries,
            "prefix_cache_hits_total": kv_cache.prefix_hits,
            # the host tier (kv_offloading_size), vLLM's "external" prefix cache: tokens looked up there
            # after a device miss, and found
            "external_prefix_cache_queries_total": kv_cache.host_cache.queries if kv_cache.host_cache else 0,
            "external_prefix_cache_hits_total": kv_cache.host_cache.hits if kv_cache.host_cache else 0,
            "swapped_out_blocks_total": self.swapped_out_blocks_total,
            "swapped_in_blocks_total": self.swapped_in_blocks_total,
        }
        return {PREFIX + k: v for k, v in values.items()}
