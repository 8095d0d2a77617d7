"""The tensor-parallel layouts of GPT-2 (learned positions, also restored from a converted folder; Conv1D
weights; an ungated MLP; LayerNorms with biases), GPT-NeoX (its per-head fused q/k/v; the parallel block's
two norms) and GPT-J (an interleaved partial rope; an LM head's bias): see layout_checks.py."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("gpt2-tp", "gpt_neox-tp", "gptj-tp"))
