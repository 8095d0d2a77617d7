"""The pieces of tensor and data parallelism that need no devices: layouts, checks, routing."""

import numpy as np
import pytest

from jaxpaged.core.host_cache import HostPrefixCache
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import Request
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.parallel import check_tensor_parallel, fuse_columns, kv_head_replicas, repeat_heads
from jaxpaged.models.config import ModelConfig
from jaxpaged.sampling_params import SamplingParams


def _config(**moe) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=64,
                       num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                       max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, o_bias=False,
                       mlp_bias=False, qk_norm=False, sliding_windows=(0, 0), rope_theta=1e4, rope_type="default",
                       **moe)


def test_fused_columns_are_shard_major():
    q, k = np.arange(8).reshape(1, 8), 100 + np.arange(4).reshape(1, 4)
    assert fuse_columns([q, k], 1, axis=1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102, 103]]
    assert fuse_columns([q, k], 2, axis=1).tolist() == [[0, 1, 2, 3, 100, 101, 4, 5, 6, 7, 102, 103]]


def test_kv_heads_repeat_in_place_so_each_device_holds_whole_heads():
    k = np.array([[10, 11, 20, 21]])   # two heads of size 2
    assert repeat_heads(k, 2, 2, axis=1).tolist() == [[10, 11, 10, 11, 20, 21, 20, 21]]
    assert kv_head_replicas(2, 8) == 4 and kv_head_replicas(2, 2) == 1 and kv_head_replicas(4, 2) == 1


def test_a_tensor_parallel_size_the_model_cannot_split_is_refused_with_the_allowed_sizes():
    for tp in (1, 2, 4, 8):
        check_tensor_parallel(_config(), tp)
    with pytest.raises(ValueError, match=r"tensor_parallel_size .*one of \[1, 2, 4, 8\], got 3"):
        check_tensor_parallel(_config(), 3)
    # experts split whole over the devices (expert parallelism): 6 experts allow 1 and 2
    moe = _config(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"experts \(6\).*one of \[1, 2\], got 4"):
        check_tensor_parallel(moe, 4)
    # OLMo's k norm spans all KV heads: they are not repeated, so tp divides them
    olmo = _config(qk_norm_full=True)
    check_tensor_parallel(olmo, 2)
    with pytest.raises(ValueError, match=r"divide its 2 KV heads: one of \[1, 2\], got 4"):
        check_tensor_parallel(olmo, 4)


def test_engine_args_refuse_bad_sizes():
    for name in ("tensor_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            EngineArgs(**{name: 0})


def test_more_devices_than_the_machine_has_is_a_clear_error():
    from jaxpaged.engine.startup import engine_devices
    with pytest.raises(ValueError, match=r"tensor_parallel_size x data_parallel_size \(4 x 2 = 8\) must be at most"):
        engine_devices(EngineArgs(tensor_parallel_size=4, data_parallel_size=2))


def test_cached_prefix_tokens_counts_the_full_blocks_a_replica_holds():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 11))
    request = Request("a", prompt, SamplingParams(max_tokens=1), (), None, 0, 1)
    kv.allocate_slots(request, len(prompt))
    kv._cache_full_blocks(request, len(prompt))
    assert kv.cached_prefix_tokens(prompt) == 8                   # two full blocks of 4
    assert kv.cached_prefix_tokens(prompt[:4] + [99] * 6) == 4    # diverges in the second block
    assert kv.cached_prefix_tokens(prompt, cache_salt="x") == 0   # another salt shares nothing
    assert kv.cached_prefix_tokens(prompt[:8]) == 4               # the last token is always computed


def test_cached_prefix_tokens_counts_the_host_tiers_blocks_after_the_devices():
    """A replica whose host tier holds a conversation's history is as good a route as one whose device
    does: the router counts the blocks the scheduler would load."""
    kv = KVCacheManager(num_blocks=5, block_size=4, host_cache=HostPrefixCache(64, lambda n: n, 8))
    prompt = list(range(1, 14))
    request = Request("a", prompt, SamplingParams(max_tokens=1), (), None, 0, 1)
    kv.allocate_slots(request, len(prompt))       # three full blocks of 4 and a last token
    kv.free(request)
    assert kv.cached_prefix_tokens(prompt) == 12
    kv.allocate_slots(Request("b", [99] * 16, SamplingParams(max_tokens=1), (), None, 0, 1), 16)   # evicts them all
    kv._store_evicted()
    assert len(kv.host_cache) == 3 and kv.pool.num_free_blocks() == 0
    assert kv.cached_prefix_tokens(prompt) == 12      # in host memory
    assert kv.cached_prefix_tokens(prompt[:4] + [0] * 9) == 4
    kv.host_cache.clear()
    assert kv.cached_prefix_tokens(prompt) == 0


class _Replica:
    def __init__(self, rank, hit, load):
        self.data_rank, self.hit, self.load = rank, hit, load
        self.kv_cache = self

    def cached_prefix_tokens(self, token_ids, salt=None, embeds_digests=()):
        return self.hit

    def get_num_unfinished_requests(self):
        return self.load


def test_requests_go_to_the_longest_prefix_hit_then_the_least_loaded_replica():
    from jaxpaged.engine.dp_engine import DataParallelEngine

    def route(*replicas):
        fake = type("Fake", (), {"engines": list(replicas)})()
        return DataParallelEngine.route(fake, [1, 2, 3]).data_rank

    assert route(_Replica(0, 0, 5), _Replica(1, 16, 9), _Replica(2, 0, 0)) == 1   # the cache hit wins
    assert route(_Replica(0, 0, 5), _Replica(1, 0, 2), _Replica(2, 0, 3)) == 1    # no hit: the least loaded
    assert route(_Replica(0, 16, 4), _Replica(1, 16, 1)) == 1                     # tied hits: the least loaded
    assert route(_Replica(0, 0, 1), _Replica(1, 0, 1)) == 0                       # full tie: the lowest rank


def test_the_kv_budget_is_per_device():
    """kv_cache_memory_bytes is per device (vLLM's per GPU): with tp 2 each device holds half of
    every block, so the same budget holds twice the blocks."""
    from jaxpaged.engine.startup import _num_blocks
    from jaxpaged.parallel import ShardPlan

    class Loaded:
        def __init__(self, size):
            self.model = type("M", (), {"shard_plan": type("Plan", (ShardPlan,), {"size": size})()})()

    args = EngineArgs(kv_cache_memory_bytes=1 << 20)
    per_block = 4096
    assert _num_blocks(args, Loaded(1), 128, per_block) == 256
    assert _num_blocks(args, Loaded(2), 128, per_block) == 512


def test_prometheus_reports_each_data_parallel_rank():
    from jaxpaged.server.metrics import MetricsExporter

    class Engine:
        max_model_len = 64

        def get_metrics_per_rank(self):
            return [{"jaxpaged:num_requests_running": 2, "jaxpaged:generation_tokens_total": 5},
                    {"jaxpaged:num_requests_running": 1, "jaxpaged:generation_tokens_total": 7}]

    from prometheus_client import generate_latest
    text = generate_latest(MetricsExporter(Engine(), "m").registry).decode()
    assert 'jaxpaged:num_requests_running{data_rank="0",model_name="m"} 2.0' in text
    assert 'jaxpaged:generation_tokens_total{data_rank="1",model_name="m"} 7.0' in text


def test_only_rank_0_serves_http_the_others_follow(monkeypatch):
    import uvicorn

    from jaxpaged import server
    from jaxpaged.engine import dp_engine

    followed = []

    class Follower:
        def follow(self):
            followed.append(True)
            return 7

    monkeypatch.setattr(dp_engine, "make_engine", lambda args: Follower())
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("a follower rank started the HTTP server"))
    args = EngineArgs(num_nodes=2, node_rank=1, distributed_coordinator="localhost:1234")
    assert server.run_server(args) == 0 and followed == [True]


def test_several_hosts_need_a_coordinator_and_one_replica():
    with pytest.raises(ValueError, match="distributed_coordinator must be HOST:PORT of rank 0"):
        EngineArgs(num_nodes=2)
    with pytest.raises(ValueError, match=r"node_rank must be an int in \[0, num_nodes=2\)"):
        EngineArgs(num_nodes=2, node_rank=2, distributed_coordinator="h:1")
    with pytest.raises(ValueError, match="data_parallel_size must be 1 when num_nodes > 1"):
        EngineArgs(num_nodes=2, distributed_coordinator="h:1", data_parallel_size=2)


def test_host_tier_moves_reach_followers_in_pieces_that_reassemble():
    """Several hosts: a plan's host-tier loads and drops travel in payloads of a bounded size (each
    broadcast shape compiled at start-up); the last piece is flagged, and an empty plan still sends one."""
    from jaxpaged.core.host_cache import HostMoves
    from jaxpaged.runner.multihost import read_tier_piece, tier_load_pieces

    moves = HostMoves([], [(1, s, 10 + s) for s in range(5)], [7, 8, 9, 11, 12, 13, 14])
    pieces = tier_load_pieces(moves, 6)
    assert len(pieces) == 5 and all(payload.size <= 6 for _, payload in pieces)
    read = [read_tier_piece(args, payload) for args, payload in pieces]
    assert [last for _, _, last in read] == [False] * 4 + [True]
    assert [load for loads, _, _ in read for load in loads] == moves.loads
    assert [drop for _, drops, _ in read for drop in drops] == moves.drops
    (args, payload), = tier_load_pieces(HostMoves([(3, [4])], [], []), 6)
    assert read_tier_piece(args, payload) == ([], [], True)


def test_the_chosen_replica_gets_the_requests_priority():
    import itertools

    from jaxpaged.engine.dp_engine import DataParallelEngine
    from jaxpaged.engine.input_processor import InputProcessor

    added = []
    replica = _Replica(0, 0, 0)
    replica.input_processor = InputProcessor(None, 1000, 64, 5, lambda n: None, "priority")
    replica.add_request = lambda *args: added.append(args)
    dp = object.__new__(DataParallelEngine)
    dp.engines, dp._owner, dp._ids = [replica], {}, itertools.count()
    dp.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1), priority=-2)
    assert added == [("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1), None, None, -2, None)]
