"""Every tensor-parallel layout on the tiny qwen2 (GQA, q/k/v bias; Pallas attention under shard_map
too), qwen3 (MQA, q/k norm; converted checkpoint with KV heads repeated) and olmo2 (q/k norms over all
heads): see layout_checks.py.
A few models per file so that the test processes share them (pytest-xdist distributes by file)."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("qwen2-gqa", "qwen3-mqa", "olmo2-tp"))
