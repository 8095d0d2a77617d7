"""Every tensor-parallel layout on the tiny qwen2 (GQA, q/k/v bias; Pallas attention under shard_map
too), qwen3 (MQA, q/k norm; converted checkpoint with KV heads repeated), olmo2 (q/k norms over all
heads) and glm4 (an interleaved partial rope, four norms a layer): see layout_checks.py.
A few models per file so that the test processes share them (pytest-xdist distributes by file)."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("qwen2-gqa", "qwen3-mqa", "olmo2-tp", "glm4-tp"))
