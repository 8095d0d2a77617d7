"""The vision part: Qwen2.5-VL-7B's vision tower (its shape, random weights, bfloat16) on the GPU: start-up
(every patch-count program compiled, up to a max_pixels) and milliseconds per image at a few sizes,
with the compilations after start-up counted (none expected)."""

import statistics
import time
import types
from typing import Iterator

from benchmarks.gpu_check.common import Context, Row, guarded

def _hf_config(vision: dict):
    """A stand-in for transformers' Qwen2_5_VLConfig: what QwenVisionTower reads."""
    fields = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu", in_channels=3,
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}, **vision)
    return types.SimpleNamespace(architectures=["Qwen2_5_VLForConditionalGeneration"], image_token_id=151655,
                                 vision_config=types.SimpleNamespace(**fields))


def _random_weights(cfg, seed: int = 0):
    """(get, has) serving random weights of the tower's shapes under the released names ("visual.")."""
    import numpy as np

    width, inner, out = cfg.width, cfg.intermediate, cfg.out_size
    merged = width * cfg.merge_size ** 2
    shapes = {"patch_embed.proj.weight": (width, 3, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
              "merger.ln_q.weight": (width,), "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
              "merger.mlp.2.weight": (out, merged), "merger.mlp.2.bias": (out,)}
    layer = {"norm1.weight": (width,), "norm2.weight": (width,), "attn.qkv.weight": (3 * width, width),
             "attn.qkv.bias": (3 * width,), "attn.proj.weight": (width, width), "attn.proj.bias": (width,),
             "mlp.gate_proj.weight": (inner, width), "mlp.gate_proj.bias": (inner,),
             "mlp.up_proj.weight": (inner, width), "mlp.up_proj.bias": (inner,),
             "mlp.down_proj.weight": (width, inner), "mlp.down_proj.bias": (width,)}
    for i in range(cfg.depth):
        shapes.update({f"blocks.{i}.{k}": v for k, v in layer.items()})
    rng = np.random.default_rng(seed)

    def get(name: str):
        shape = shapes[name.removeprefix("visual.")]
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("ln_q.weight"):
            return np.ones(shape, np.float32)
        return (rng.random(shape, dtype=np.float32) - 0.5) * 0.04
    return get, lambda name: name.removeprefix("visual.") in shapes


def vision_check(ctx: Context) -> Iterator[Row]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.gpu_check.step import compilations
    from jaxpaged.models.qwen_vision import QwenVisionTower, qwen_vision_config

    sizes = ctx.sizes
    hf_config = _hf_config(sizes.vision_model)
    cfg = qwen_vision_config(hf_config)
    holder = {}

    def start() -> Row:
        get, has = _random_weights(cfg)
        begin = time.perf_counter()
        tower = QwenVisionTower(hf_config, get, has, jnp.bfloat16, jax.devices()[0])
        tower.limit_pixels(sizes.vision_max_pixels)
        loaded = time.perf_counter()
        tower.warm_up()
        holder["tower"] = tower
        return Row("vision", "start-up", "ok", {"load s": round(loaded - begin, 1),
                                                 "warm-up s": round(time.perf_counter() - loaded, 1),
                                                 "programs": len(tower.buckets), "most patches": tower.buckets[-1]})
    yield guarded("vision", "start-up", start)
    if "tower" not in holder:
        return
    tower = holder["tower"]
    rng = np.random.default_rng(1)
    for side in sizes.vision_sides:
        case = f"image {side}x{side}"

        def one(side=side, case=case) -> Row:
            grid = (1, side // cfg.patch_size, side // cfg.patch_size)
            n = int(np.prod(grid))
            pixels = rng.standard_normal((n, cfg.patch_dim), dtype=np.float32)
            seconds = []
            with compilations() as compiled:
                for _ in range(sizes.timing_rounds):
                    begin = time.perf_counter()
                    rows = tower.image_rows(pixels, grid)
                    seconds.append(time.perf_counter() - begin)
            bucket = next(b for b in tower.buckets if b >= n)
            finite = bool(np.isfinite(rows.astype(np.float32)).all())
            return Row("vision", case, "ok" if finite and not compiled else "fail",
                       {"patches": n, "padded to": bucket, "tokens": len(rows),
                        "ms/image": round(statistics.median(seconds) * 1e3, 2), "compiles": len(compiled)},
                       note="" if finite else "non-finite rows")
        yield guarded("vision", case, one)
