"""Expert parallelism on the tiny mixtral, qwen2_moe (a shared expert and a dense layer), gpt_oss
(expert biases, attention sinks), deepseek_v3 (latent attention, grouped sigmoid routing; experts split
over the devices, routing replicated) and minimax_m2 (q/k norms over all heads, sigmoid routing): see
layout_checks.py. A few models per file so that the test processes share them (pytest-xdist distributes
by file)."""

from tests.parallel.layout_checks import layout_tests

globals().update(layout_tests("mixtral-ep", "qwen2_moe-ep", "gpt_oss-ep", "deepseek_v3-tp", "minimax_m2-ep"))
