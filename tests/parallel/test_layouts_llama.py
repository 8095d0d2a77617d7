"""Every parallel layout on the tiny llama (MHA; restored from its converted checkpoint too): see
layout_checks.py. One file per model so that the test processes share the models (pytest-xdist
distributes by file)."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("llama-mha"))
