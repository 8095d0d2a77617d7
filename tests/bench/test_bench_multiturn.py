"""`jaxpaged bench multiturn`: the three engines' TTFTs and prompt tokens computed, on a tiny model."""

import json
import re

from jaxpaged.benchmarks import multiturn
from jaxpaged.benchmarks.latency import tiny_model


def test_multiturn_prints_the_tier_against_no_tier_and_the_pool_for_all(capsys, tmp_path):
    assert multiturn.main(["--model", tiny_model(), "--conversations", "4", "--turns", "3", "--system-len", "40",
                           "--user-len", "16", "--answer-len", "4", "--blocks", "20", "--tier-gib", "0.01", "--max-num-seqs", "4",
                           "--json", str(tmp_path / "runs.json")]) == 0
    out = capsys.readouterr().out
    for name in ("tier", "no tier", "pool for all"):
        assert re.search(rf"{name}: TTFT p50 +\d+\.\d ms +p99 +\d+\.\d ms +prompt tokens computed +\d+", out), out
    assert "greedy answers identical" in out
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert runs["tier"]["host_hit_tokens"] > 0 and runs["no tier"]["host_hit_tokens"] == 0
    assert runs["tier"]["prompt_tokens_computed"] < runs["no tier"]["prompt_tokens_computed"]
