"""Every parallel layout on the tiny qwen2 (GQA, q/k/v bias; Pallas attention under shard_map too): see
layout_checks.py. One file per model so that the test processes share the models (pytest-xdist
distributes by file)."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("qwen2-gqa"))
