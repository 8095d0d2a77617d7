"""Speculative decoding under tensor and data parallelism (8 forced CPU devices, a subprocess):
every layout verifies drafts and gives the single-device tokens, with and without speculation."""

from tests.parallel.layout_checks import run_worker

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def test_verification_gives_the_same_tokens_in_every_layout():
    layouts = [[1, 1], [2, 1], [1, 2]]
    runs = run_worker({"arch": "llama", "overrides": {"num_key_value_heads": 4}, "layouts": layouts,
                       "engine": {"speculative_config": NGRAM}, "plain_layouts": [[1, 1]]})   # one subprocess
    plain = runs.pop("plain-1x1")
    assert plain["per_rank"][0].get("jaxpaged:spec_decode_num_draft_tokens_total", 0) == 0   # no speculation
    assert len(runs) == len(layouts)
    for name, result in runs.items():
        assert result["tokens"] == plain["tokens"], name
        drafted = sum(m["jaxpaged:spec_decode_num_draft_tokens_total"] for m in result["per_rank"])
        assert drafted > 0, f"{name}: nothing was verified"
