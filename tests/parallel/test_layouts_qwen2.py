"""Every parallel layout on the tiny qwen2 (GQA, q/k/v bias; Pallas attention under shard_map too): see layout_checks.py."""

import pytest

from tests.parallel.layout_checks import (check_data_parallel_spreads_requests_and_sums_metrics,
                                          check_each_device_holds_its_share_of_the_weights_and_the_kv_pool,
                                          check_every_layout_and_the_converted_checkpoint_give_the_single_device_tokens_and_logprobs,
                                          run_case)


@pytest.fixture(scope="module")
def case():
    return run_case("qwen2-gqa")


def test_every_layout_gives_the_single_device_tokens_and_logprobs(case):
    check_every_layout_and_the_converted_checkpoint_give_the_single_device_tokens_and_logprobs(case)


def test_each_device_holds_its_share_of_the_weights_and_the_kv_pool(case):
    check_each_device_holds_its_share_of_the_weights_and_the_kv_pool(case)


def test_data_parallel_spreads_requests_and_sums_metrics(case):
    check_data_parallel_spreads_requests_and_sums_metrics(case)
