"""The tensor-parallel layouts of GPT-2 (learned positions, also restored from a converted folder; Conv1D
weights; an ungated MLP; LayerNorms with biases) and GPT-NeoX (its per-head fused q/k/v; the parallel block's
two norms): see layout_checks.py."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("gpt2-tp", "gpt_neox-tp"))
