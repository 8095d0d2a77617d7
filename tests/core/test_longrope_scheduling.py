"""LongRoPE in the scheduler, with the fake model of test_scheduler: a request outgrowing the model's
original length is recomputed once with the long factors, on blocks hashed apart from short ones."""

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import RequestStatus
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from tests.core.test_scheduler import Driver, assert_no_blocks_held, make_request


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_longrope_request_outgrowing_its_factors_is_recomputed_once_on_other_blocks(mode):
    """A request that began at most rope_switch_len (10) tokens long is recomputed from its first
    token when it outgrows them, whatever the preemption mode, and its blocks' hashes change (the
    blocks it held stay cached under the short chain); one that began longer never is."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, preemption_mode=mode)
    s = Scheduler(config, KVCacheManager(32, 4, num_host_blocks=16 if mode == "swap" else 0, rope_switch_len=10))
    s.add_request(make_request("short", 7, max_tokens=8))
    s.add_request(make_request("long", 12, max_tokens=8))
    driver = Driver(s)
    short = s.requests["short"]
    driver.step()
    assert (short.rope_len, s.requests["long"].rope_len) == (7, 12)
    while short.num_tokens <= 10:
        out = driver.step()
        assert out.preempted == []
    short_hashes = list(short.block_hashes)
    out = driver.step()   # 11 tokens: the 11th token's K/V would be the first with long factors
    assert out.preempted == [short] and short.status == RequestStatus.WAITING and short.num_computed_tokens == 0
    out = driver.step()
    (chunk,) = [c for c in out.chunks if c.request is short]
    assert chunk.start == 0 and chunk.num_new_tokens == 11 and short.rope_len == 11
    assert short.block_hashes[0] != short_hashes[0]
    assert s.kv_cache.pool.lookup(short_hashes[0]) is not None   # the short chain is still a valid prefix
    driver.run()
    assert short.num_preemptions == 1 and driver.finished["long"].num_preemptions == 0
    assert driver.finished["short"].num_output_tokens == 8
    assert_no_blocks_held(s)
