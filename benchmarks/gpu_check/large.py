"""The 8B part (issue #22): Llama-3.1-8B's shape, decode at 32 sequences against its bytes floor
(goal: at most 1.3x), with the default engine arguments.

No 16 GB checkpoint is built: the part writes the model's config.json and the engine draws its
weights on the GPU (`load_format="dummy"`, vLLM's), so start-up is the engine's own. The dummy
weights' outputs mean nothing; the step reads the same bytes as a real model's.
"""

import json
import os
import time
from typing import Iterator

from benchmarks.gpu_check.common import Context, Row, guarded

LARGE_FOLDER = "model-8b"
FLOOR_GOAL = 1.3   # decode ms/step at most this many times the bytes floor at 32 sequences


def large_model_check(ctx: Context) -> Iterator[Row]:
    from benchmarks.gpu_check.step import _decode_row, _startup_row, compilations
    from jaxpaged import LLM

    sizes = ctx.sizes
    model = sizes.large_model
    path = os.path.join(ctx.workdir, LARGE_FOLDER)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model, f)
    holder = {}

    def start() -> Row:
        with compilations() as compiled:
            begin = time.perf_counter()
            holder["llm"] = LLM(path, load_format="dummy", **sizes.step_engine_args)
            seconds = time.perf_counter() - begin
        return _startup_row(holder["llm"], seconds, compiled, {"load_format": "dummy", **sizes.step_engine_args},
                            case="8B start-up")
    yield guarded("step", "8B start-up", start)
    if "llm" not in holder:
        return
    llm = holder["llm"]
    weight_bytes = sum(x.nbytes for x in _weights(llm))
    copy = [r.data["gbps"] for r in ctx.rows_of("copy") if "gbps" in r.data]
    for num_seqs in sizes.large_decode_seqs:
        case = f"8B decode {num_seqs} seqs"

        def decode(num_seqs=num_seqs, case=case) -> Row:
            row = _decode_row(llm, sizes, num_seqs, weight_bytes, copy[0] if copy else None, model=model, case=case)
            if "x floor" in row.metrics:
                row.metrics.update({"goal x floor": FLOOR_GOAL, "meets": row.metrics["x floor"] <= FLOOR_GOAL})
            return row
        yield guarded("step", case, decode)


def _weights(llm) -> list:
    """The engine's weight arrays on the device (the step reads each once)."""
    import jax

    return jax.tree.leaves(llm.llm_engine.runner.state)
