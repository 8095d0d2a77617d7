"""The vision tower of Qwen2-VL and Qwen2.5-VL, and their multimodal rope (M-RoPE) positions, as transformers'
`Qwen2VLModel` / `Qwen2_5_VLModel` compute them.

An image keeps its own size (the processor's smart_resize to multiples of 28 pixels, between min and max pixels):
its pixel_values are patches of 14 x 14 pixels (two frames of the one image, a 3D convolution's input) in groups of
2 x 2, each group one row, one token, of the language model. The tower's attention turns a 2D rope over each
patch's (row, column); Qwen2-VL's layers see the whole image, Qwen2.5-VL's see windows of 8 x 8 patches but for its
`fullatt_block_indexes`. Patches are padded to a power of two (one compiled program per size, all compiled at
start-up); a layer over the whole image masks out the padding, one block of queries at a time; a windowed layer
gathers each window's patches (as many windows as an image of that many patches may have) and attends within them.

In the language model, an image's tokens turn the rope by three positions (time, height, width): the image's
start, plus each token's row and column; the text after it goes on from the image's start plus its longer side.
Request.mrope_offsets holds the difference from plain positions, mrope_delta what every later token adds."""

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.norms import layer_norm, rms_norm
from jaxpaged.models.rope import apply_rotary
from jaxpaged.models.vision import ImageTower, named_activation, torch_linear

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN_VL_ARCHITECTURES = (QWEN2_VL, QWEN2_5_VL)
_DEFAULT_MAX_PIXELS = 12845056   # the processors' default (3584 x 3584)
_SCORES_PER_BLOCK = 1 << 27      # attention scores (f32) held at once: queries are taken in blocks of this many
_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    windowed: bool          # Qwen2.5-VL: RMSNorms, a gated MLP with biases, window attention
    width: int
    num_heads: int
    depth: int
    intermediate: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int         # a token is merge_size x merge_size patches
    act: str
    out_size: int           # the language model's hidden size
    window: int             # Qwen2.5-VL: a window's side, in tokens (window_size // merge_size // patch_size)
    full_layers: tuple[int, ...]   # Qwen2.5-VL: the layers that see the whole image
    rope_theta: float

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2


def qwen_vision_config(hf_config: Any) -> QwenVisionConfig:
    vc = hf_config.vision_config
    rope = getattr(vc, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", 10000.0))
    if getattr(vc, "in_channels", getattr(vc, "in_chans", 3)) != 3:
        raise ValueError("a Qwen2-VL vision tower of other than 3 input channels is not supported")
    common = dict(num_heads=vc.num_heads, depth=vc.depth, patch_size=vc.patch_size,
                  temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size, act=vc.hidden_act,
                  rope_theta=theta)
    if hf_config.architectures[0] == QWEN2_VL:
        return QwenVisionConfig(False, vc.embed_dim, intermediate=int(vc.embed_dim * vc.mlp_ratio),
                                out_size=vc.hidden_size, window=0, full_layers=tuple(range(vc.depth)), **common)
    return QwenVisionConfig(True, vc.hidden_size, intermediate=vc.intermediate_size, out_size=vc.out_hidden_size,
                            window=vc.window_size // vc.spatial_merge_size // vc.patch_size,
                            full_layers=tuple(vc.fullatt_block_indexes), **common)


def has_qwen_vision_tower(hf_config: Any) -> bool:
    architectures = getattr(hf_config, "architectures", None) or []
    return bool(architectures) and architectures[0] in QWEN_VL_ARCHITECTURES and \
        getattr(hf_config, "vision_config", None) is not None


def load_qwen_vision_weights(cfg: QwenVisionConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                             dtype, device) -> dict:
    """The tower's weights (its layers stacked) and the merger's, on `device`: released checkpoints' names
    ("visual.") or transformers 5's ("model.visual.")."""
    prefix = next((p for p in ("model.visual.", "visual.") if has(p + "patch_embed.proj.weight")), None)
    if prefix is None:
        raise ValueError("the checkpoint has no vision tower weights (visual.patch_embed.proj.weight)")
    norms = ("norm1.weight", "norm2.weight") + (() if cfg.windowed else ("norm1.bias", "norm2.bias"))
    mlp = ("gate_proj", "up_proj", "down_proj") if cfg.windowed else ("fc1", "fc2")
    parts = norms + ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias") + \
        tuple(f"mlp.{m}.{k}" for m in mlp for k in ("weight", "bias"))
    w = {"patch": get(prefix + "patch_embed.proj.weight").reshape(cfg.width, -1),
         "layers": {p: np.stack([get(f"{prefix}blocks.{i}.{p}") for i in range(cfg.depth)]) for p in parts},
         "ln_q": (get(prefix + "merger.ln_q.weight"),
                  None if cfg.windowed else get(prefix + "merger.ln_q.bias")),
         "mlp_0": (get(prefix + "merger.mlp.0.weight"), get(prefix + "merger.mlp.0.bias")),
         "mlp_2": (get(prefix + "merger.mlp.2.weight"), get(prefix + "merger.mlp.2.bias"))}

    def put(x):
        return None if x is None else jax.device_put(np.asarray(x).astype(dtype), device)
    return jax.tree.map(put, w, is_leaf=lambda x: x is None)


def _norm(cfg: QwenVisionConfig, x: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
    return rms_norm(x, weight, _NORM_EPS) if cfg.windowed else layer_norm(x, weight, _NORM_EPS, bias=bias)


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array) -> jax.Array:
    """Each patch attends to the patches of its segment (its image; padding, its own): q, k, v [B, heads, dim];
    queries a block at a time, so that no more than _SCORES_PER_BLOCK scores are held."""
    n, heads, dim = q.shape
    block = n
    while block > 8 and block * n * heads > _SCORES_PER_BLOCK:
        block //= 2

    def one(args):
        qb, sb = args
        scores = jnp.einsum("qhd,khd->hqk", qb, k, preferred_element_type=jnp.float32) * dim ** -0.5
        scores = jnp.where((sb[:, None] == segment[None, :])[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("hqk,khd->qhd", probs, v.astype(jnp.float32))
    out = jax.lax.map(one, (q.reshape(n // block, block, heads, dim), segment.reshape(n // block, block)))
    return out.reshape(n, heads, dim)


def _window_attention(q: jax.Array, k: jax.Array, v: jax.Array, windows: jax.Array, slots: jax.Array) -> jax.Array:
    """Each patch attends to the patches of its window: windows i32[W, P], each window's patches (-1: none);
    slots i32[B], each patch's place in windows (flattened)."""
    dim = q.shape[-1]
    taken = jnp.maximum(windows, 0)
    scores = jnp.einsum("wqhd,wkhd->whqk", q[taken], k[taken], preferred_element_type=jnp.float32) * dim ** -0.5
    scores = jnp.where((windows >= 0)[:, None, None, :], scores, -1e30)   # (finite: a window of no patches)
    out = jnp.einsum("whqk,wkhd->wqhd", jax.nn.softmax(scores, axis=-1), v[taken].astype(jnp.float32))
    return out.reshape(-1, *q.shape[1:])[slots]


def _layer(cfg: QwenVisionConfig, x: jax.Array, lw: dict, cos: jax.Array, sin: jax.Array,
           attend: Callable) -> jax.Array:
    n = x.shape[0]
    heads = cfg.num_heads
    y = _norm(cfg, x, lw["norm1.weight"], lw.get("norm1.bias"))
    qkv = torch_linear(y, lw["attn.qkv.weight"], lw["attn.qkv.bias"]).astype(x.dtype).reshape(n, 3, heads, -1)
    q, k = apply_rotary(qkv[:, 0], cos, sin), apply_rotary(qkv[:, 1], cos, sin)
    attn = attend(q, k, qkv[:, 2]).reshape(n, -1).astype(x.dtype)
    x = x + torch_linear(attn, lw["attn.proj.weight"], lw["attn.proj.bias"]).astype(x.dtype)
    y = _norm(cfg, x, lw["norm2.weight"], lw.get("norm2.bias"))
    if cfg.windowed:
        gate = named_activation(cfg.act, torch_linear(y, lw["mlp.gate_proj.weight"], lw["mlp.gate_proj.bias"])
                                .astype(x.dtype))
        y = (gate * torch_linear(y, lw["mlp.up_proj.weight"], lw["mlp.up_proj.bias"])).astype(x.dtype)
        return x + torch_linear(y, lw["mlp.down_proj.weight"], lw["mlp.down_proj.bias"]).astype(x.dtype)
    y = named_activation(cfg.act, torch_linear(y, lw["mlp.fc1.weight"], lw["mlp.fc1.bias"])).astype(x.dtype)
    return x + torch_linear(y, lw["mlp.fc2.weight"], lw["mlp.fc2.bias"]).astype(x.dtype)


def _runs(cfg: QwenVisionConfig) -> list[tuple[int, int, bool]]:
    """The layers as runs of the same kind: (first, end, over the whole image)."""
    runs: list[tuple[int, int, bool]] = []
    for i in range(cfg.depth):
        full = i in cfg.full_layers
        if runs and runs[-1][2] == full:
            runs[-1] = (runs[-1][0], i + 1, full)
        else:
            runs.append((i, i + 1, full))
    return runs


@functools.partial(jax.jit, static_argnums=0)
def qwen_image_features(cfg: QwenVisionConfig, w: dict, patches: jax.Array, layout: dict) -> jax.Array:
    """patches f32[B, patch_dim] (pixel_values, padded to B) and their `layout` (patch_layout) -> [B /
    merge_size^2, out_size] in the weights' dtype."""
    dtype = w["patch"].dtype
    n = patches.shape[0]
    x = torch_linear(patches.astype(dtype), w["patch"], None).astype(dtype)
    spatial = cfg.width // cfg.num_heads // 2
    inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial)
    freqs = (layout["rows_cols"].astype(jnp.float32)[:, :, None] * inv).reshape(n, -1)   # the row's, the column's
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    for first, end, full in _runs(cfg):   # (a scan over each run of layers of one kind)
        attend = functools.partial(_masked_attention, segment=layout["frames"]) if full else \
            functools.partial(_window_attention, windows=layout["windows"], slots=layout["slots"])

        def step(h, lw, attend=attend):
            return _layer(cfg, h, lw, cos, sin, attend), None
        x = jax.lax.scan(step, x, jax.tree.map(lambda a, first=first, end=end: a[first:end], w["layers"]))[0]
    y = _norm(cfg, x, *w["ln_q"]).reshape(n // cfg.merge_size ** 2, -1)
    y = named_activation("gelu", torch_linear(y, *w["mlp_0"])).astype(dtype)
    return torch_linear(y, *w["mlp_2"]).astype(dtype)


def patch_layout(cfg: QwenVisionConfig, grid: tuple[int, int, int], bucket: int) -> dict:
    """The layout of an image's n = t x h x w patches (in the processor's order: frame, token row, token column,
    then the token's merge_size x merge_size patches) padded to `bucket` patches: rows_cols i32[bucket, 2], each
    patch's row and column; frames i32[bucket], its frame (padding: -1); Qwen2.5-VL's windows i32[W, P], each
    window's patches (-1: none), W the most windows an image of `bucket` patches may have, and slots i32[bucket],
    each patch's place in windows (transformers' get_vision_position_ids and get_vision_window_index)."""
    t, h, w = grid
    m = cfg.merge_size
    frame, token_row, token_col, r, c = (a.reshape(-1) for a in np.meshgrid(
        np.arange(t), np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m), indexing="ij"))
    pad = bucket - len(frame)
    layout = {"rows_cols": np.pad(np.stack([token_row * m + r, token_col * m + c], axis=-1), ((0, pad), (0, 0))),
              "frames": np.pad(frame, (0, pad), constant_values=-1)}
    if cfg.window:
        across = -(-(w // m) // cfg.window)   # windows in a row of windows (the last may be partial)
        window = (frame * -(-(h // m) // cfg.window) + token_row // cfg.window) * across + token_col // cfg.window
        order = np.argsort(window, kind="stable")
        first = np.searchsorted(window[order], window[order])   # each patch's window's first place in `order`
        place = np.empty_like(order)
        place[order] = np.arange(len(order)) - first             # its place in its window
        size = (cfg.window * m) ** 2
        windows = np.full(((bucket // m ** 2) // cfg.window + 1, size), -1)
        windows[window, place] = np.arange(len(window))
        layout["windows"] = windows
        layout["slots"] = np.pad(window * size + place, (0, pad))
    return {k: v.astype(np.int32) for k, v in layout.items()}


def mrope_positions(num_tokens: int, images: list[tuple[int, tuple[int, int, int]]], merge_size: int
                    ) -> tuple[np.ndarray, int]:
    """(offsets i32[end, 3], delta): a prompt's M-RoPE positions (time, height, width) as transformers'
    get_rope_index gives them, less (position + delta), for its tokens up to the last image's end (every later
    token's positions are position + delta); `images`: each image's first token and grid (t, h, w) in patches,
    in order. delta: the largest position + 1 - num_tokens."""
    end = images[-1][0] + images[-1][1][0] * images[-1][1][1] * images[-1][1][2] // merge_size ** 2
    positions = np.zeros((end, 3), np.int64)
    shift, done = 0, 0   # shift: what the text after the last image adds to its positions
    for start, (t, h, w) in images:
        positions[done:start] = (np.arange(done, start) + shift)[:, None]
        h, w = h // merge_size, w // merge_size
        first = start + shift
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        positions[start:start + t * h * w] = np.stack([ti, hi, wi], axis=-1).reshape(-1, 3) + first
        done = start + t * h * w
        shift = first + max(h, w) - done
    delta = max(int(positions.max(initial=-1)) + 1, num_tokens + shift) - num_tokens
    return (positions - (np.arange(end) + delta)[:, None]).astype(np.int32), delta


class QwenVisionTower(ImageTower):
    """A Qwen2-VL or Qwen2.5-VL checkpoint's tower and merger on one device: `image_rows` turns an image's
    pixel_values (patches) and grid into the language model's input rows; `mrope` gives a prompt's M-RoPE."""

    sized_by_processor = True   # one program per power-of-two patch count, up to the processor's max_pixels
    uses_mrope = True

    def __init__(self, hf_config: Any, get: Callable[[str], np.ndarray], has: Callable[[str], bool], dtype, device):
        config = qwen_vision_config(hf_config)
        super().__init__(config, load_qwen_vision_weights(config, get, has, dtype, device), device, dtype,
                         hf_config.image_token_id)
        self.limit_pixels(_DEFAULT_MAX_PIXELS)

    def limit_pixels(self, max_pixels: int) -> None:
        """Take images of up to `max_pixels` (the image processor's max_pixels): the patch counts compiled for
        are the powers of two from 256 (or fewer) up to the first that holds them."""
        self.max_patches = max(int(max_pixels) // self.config.patch_size ** 2, self.config.merge_size ** 2)
        top = 1 << (self.max_patches - 1).bit_length()
        self.buckets = [b for b in (1 << i for i in range(top.bit_length())) if min(256, top) <= b <= top]

    def fit_processor(self, processor) -> None:
        """Take the images the engine's image processor makes (its max_pixels, or size['longest_edge'])."""
        size = getattr(processor, "size", None)   # (transformers' SizeDict, or a dict)
        most = getattr(processor, "max_pixels", None) or getattr(size, "longest_edge", None) or \
            (size.get("longest_edge") if isinstance(size, dict) else None)
        if most:
            self.limit_pixels(most)

    def num_rows(self, grid: tuple[int, int, int], alone: bool = True) -> int:
        """How many rows (tokens) an image of `grid` (t, h, w patches) gives."""
        return int(np.prod(grid)) // self.config.merge_size ** 2

    def image_rows(self, pixels: np.ndarray, grid: tuple[int, int, int], alone: bool = True) -> np.ndarray:
        """One image's rows [tokens, text hidden]: pixel_values [t x h x w, patch_dim] and its grid."""
        n = int(np.prod(grid))
        if pixels.shape != (n, self.config.patch_dim):
            raise ValueError(f"the image processor gave pixel_values of shape {pixels.shape} for a grid of {grid}; "
                             f"this vision tower takes [{n}, {self.config.patch_dim}]")
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            raise ValueError(f"the image has {n} patches; this vision tower takes up to {self.max_patches} (the "
                             "image processor's max_pixels)")
        if grid[0] != 1:
            raise ValueError(f"an image of {grid[0]} frames (a video's grid) is not supported")
        return self._run(bucket, pixels, grid)[:n // self.config.merge_size ** 2]

    def _run(self, bucket: int, pixels: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        padded = np.zeros((bucket, self.config.patch_dim), np.float32)
        padded[:len(pixels)] = pixels
        args = jax.device_put((padded, patch_layout(self.config, grid, bucket)), self.device)
        return np.asarray(self._program(bucket)(self.weights, *args))

    def _program(self, bucket: int):
        """The compiled program of `bucket` patches (compiled now if warm_up did not)."""
        m = self.config.merge_size
        return self._compiled(bucket, qwen_image_features, np.zeros((bucket, self.config.patch_dim), np.float32),
                              patch_layout(self.config, (1, m, m), bucket))

    def mrope(self, num_tokens: int, images: list[tuple[int, tuple[int, int, int]]]) -> tuple[np.ndarray, int]:
        """Request.mrope_offsets and mrope_delta of a prompt of `num_tokens` whose images start at, and have
        the grids of, `images` ((first token, grid), in order)."""
        return mrope_positions(num_tokens, images, self.config.merge_size)

    def warm_up(self) -> None:
        """Compile every bucket's program (engines compile nothing after start-up); nothing runs."""
        for bucket in self.buckets:
            self._program(bucket)
