"""Every parallel layout on the tiny qwen3 (MQA, q/k norm; converted checkpoint with KV heads
repeated): see layout_checks.py. One file per model so that the test processes share the models
(pytest-xdist distributes by file)."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("qwen3-mqa"))
