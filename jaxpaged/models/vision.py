"""The vision tower of a LLaVA checkpoint (LLaVA, LLaVA-NeXT, LLaVA-OneVision): a CLIP or SigLIP vision
transformer whose hidden states at `vision_feature_layer` go through the multimodal projector into rows of
the language model's input embeddings, one per image token, as transformers' `get_image_features` (NeXT's and
OneVision's tiles packed as their `pack_image_features`).

It runs on one of the engine's devices when a request is added (engine/multimodal.py), one tile per call
(one compiled shape, compiled at start-up), and its rows stand in the prompt for the image's tokens."""

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.config import ACTIVATIONS
from jaxpaged.models.moe import activation
from jaxpaged.models.norms import layer_norm

VISION_TOWERS = ("clip_vision_model", "siglip_vision_model")
# the vision-language checkpoints whose images run: LLaVA (one tile), LLaVA-NeXT (a base tile and a grid of them)
LLAVA_NEXT = "LlavaNextForConditionalGeneration"
LLAVA_ONEVISION = "LlavaOnevisionForConditionalGeneration"   # NeXT's grid, downsized past a bound, for one image
IMAGE_ARCHITECTURES = ("LlavaForConditionalGeneration", LLAVA_NEXT, LLAVA_ONEVISION)
_SELECT_STRATEGIES = ("default", "full")


def named_activation(name: str, x: jax.Array) -> jax.Array:
    """A tower's or projector's activation (transformers' name), in f32: models/moe.activation's."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported in a vision tower or projector; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    return activation(ACTIVATIONS[name], x)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    kind: str                    # "clip_vision_model" (a class token, a norm before the layers) or "siglip_..."
    hidden_size: int
    num_heads: int
    num_layers: int              # the layers run: up to the deepest feature layer
    patch_size: int
    image_size: int
    num_channels: int
    eps: float
    act: str
    projector_act: str
    feature_layers: tuple[int, ...]   # indices into [embeddings, layer 1, ..., layer N], each >= 0
    drop_first: bool             # vision_feature_select_strategy "default": the first row (CLS) dropped

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (self.kind == "clip_vision_model")

    @property
    def tokens_per_image(self) -> int:
        return self.num_positions - self.drop_first


def pack_tiles(tiles: np.ndarray, rows: int, cols: int, image_size: tuple[int, int], newline: np.ndarray,
               max_tiles: int | None = None):
    """LLaVA-NeXT's rows of an image (transformers' pack_image_features, "spatial_unpad"): the whole image's
    tile, then the grid's features as one picture, the padding the processor added cut off again (LLaVA-OneVision:
    downsized, bilinear, to about `max_tiles` tiles' worth), each of its rows ended by `newline`.
    tiles: [1 + rows x cols, side x side, hidden]."""
    base, grid = tiles[0], tiles[1:]
    if not len(grid):
        return np.concatenate([base, newline[None]])
    side = int(round(grid.shape[1] ** 0.5))
    hidden = grid.shape[-1]
    picture = grid.reshape(rows, cols, side, side, hidden).transpose(4, 0, 2, 1, 3).reshape(
        hidden, rows * side, cols * side)
    kept_rows, kept_cols = _unpadded(picture.shape[1], picture.shape[2], image_size)
    picture = picture[:, kept_rows, kept_cols]
    ratio = 0.0 if max_tiles is None else math.sqrt(picture.shape[1] * picture.shape[2] / (max_tiles * side ** 2))
    if ratio > 1.1:   # (OneVision's "anyres_max_N")
        picture = _bilinear(picture, int(picture.shape[1] // ratio), int(picture.shape[2] // ratio))
    ends = np.broadcast_to(newline[:, None, None], (hidden, picture.shape[1], 1)).astype(picture.dtype)
    picture = np.concatenate([picture, ends], axis=-1).reshape(hidden, -1).T
    return np.concatenate([base, picture])


def _bilinear(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """x [channels, h, w] resized to [channels, height, width] as torch's interpolate(mode="bilinear") does
    (align_corners=False, no antialiasing), in f32."""
    def taps(n_in: int, n_out: int):
        src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
        lo = np.minimum(src.astype(np.int64), n_in - 1)
        return lo, np.minimum(lo + 1, n_in - 1), (src - lo).astype(np.float32)
    (r0, r1, fr), (c0, c1, fc) = taps(x.shape[1], height), taps(x.shape[2], width)
    x = x.astype(np.float32)
    top = x[:, r0][:, :, c0] * (1 - fc) + x[:, r0][:, :, c1] * fc
    bottom = x[:, r1][:, :, c0] * (1 - fc) + x[:, r1][:, :, c1] * fc
    return top * (1 - fr)[:, None] + bottom * fr[:, None]


def _unpadded(cur_h: int, cur_w: int, image_size: tuple[int, int]) -> tuple[slice, slice]:
    """The rows and columns of a grid picture (cur_h x cur_w) that hold the image, not the padding the
    processor added around it to fit the grid's shape (transformers' unpad_image)."""
    height, width = image_size
    if width / height > cur_w / cur_h:   # padded above and below
        pad = (cur_h - int(round(height * (cur_w / width), 7))) // 2
        return slice(pad, cur_h - pad), slice(None)
    pad = (cur_w - int(round(width * (cur_h / height), 7))) // 2   # padded left and right
    return slice(None), slice(pad, cur_w - pad)


def has_vision_tower(hf_config: Any) -> bool:
    """A checkpoint whose images jaxpaged runs: LLaVA, LLaVA-NeXT or OneVision with a CLIP or SigLIP tower (other
    vision-language checkpoints run their language model alone, models/vision_language.py)."""
    architectures = getattr(hf_config, "architectures", None) or []
    vc = getattr(hf_config, "vision_config", None)
    return bool(architectures) and architectures[0] in IMAGE_ARCHITECTURES and \
        getattr(vc, "model_type", None) in VISION_TOWERS


def vision_config(hf_config: Any) -> VisionConfig:
    """A LLaVA config's vision tower; ValueError for one jaxpaged does not run."""
    vc = hf_config.vision_config
    if vc.model_type not in VISION_TOWERS:
        raise ValueError(f"vision tower {vc.model_type!r} is not supported; supported: {', '.join(VISION_TOWERS)}")
    strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
    if strategy not in _SELECT_STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy must be one of {', '.join(_SELECT_STRATEGIES)}, "
                         f"got {strategy!r}")
    layers = hf_config.vision_feature_layer
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    total = vc.num_hidden_layers + 1   # hidden states: the embeddings, then each layer's output
    if not all(-total <= i < total for i in layers):
        raise ValueError(f"vision_feature_layer {hf_config.vision_feature_layer!r} is outside the tower's "
                         f"{total} hidden states")
    layers = tuple(i % total for i in layers)
    return VisionConfig(vc.model_type, vc.hidden_size, vc.num_attention_heads, max(layers), vc.patch_size,
                        vc.image_size, vc.num_channels, vc.layer_norm_eps, vc.hidden_act,
                        getattr(hf_config, "projector_hidden_act", "gelu"), layers, strategy == "default")


def _prefixes(has: Callable[[str], bool]) -> tuple[str, str]:
    """The tower's and the projector's name prefixes: released checkpoints' ("vision_tower.vision_model."),
    transformers 5's in memory ("model.vision_tower.") or as it saves them ("vision_tower.")."""
    towers = [f"{top}vision_tower.{inner}" for top in ("model.", "") for inner in ("vision_model.", "")]
    tower = next((t for t in towers if has(t + "embeddings.patch_embedding.weight")), None)
    projector = next((p for p in ("model.multi_modal_projector.", "multi_modal_projector.")
                      if has(p + "linear_1.weight")), None)
    if tower is None or projector is None:
        raise ValueError("the checkpoint has no vision tower or multimodal projector weights "
                         "(vision_tower.vision_model.embeddings..., multi_modal_projector.linear_1...)")
    return tower, projector


def load_vision_weights(cfg: VisionConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                        dtype, device) -> dict:
    """The tower's weights (its layers stacked, as many as it runs) and the projector's, on `device`."""
    tower, projector = _prefixes(has)

    def opt(name: str):
        return get(name) if has(name) else None

    w: dict = {"patch": get(tower + "embeddings.patch_embedding.weight"),
               "patch_bias": opt(tower + "embeddings.patch_embedding.bias"),
               "positions": get(tower + "embeddings.position_embedding.weight")[:cfg.num_positions],
               "class": opt(tower + "embeddings.class_embedding")}
    w["pre_norm"] = opt(tower + "pre_layrnorm.weight"), opt(tower + "pre_layrnorm.bias")
    parts = ("layer_norm1.weight", "layer_norm1.bias", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
             "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
             "self_attn.out_proj.weight", "self_attn.out_proj.bias", "layer_norm2.weight", "layer_norm2.bias",
             "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")
    w["layers"] = {p: np.stack([get(f"{tower}encoder.layers.{i}.{p}") for i in range(cfg.num_layers)])
                   for p in parts} if cfg.num_layers else {}
    for name in ("linear_1", "linear_2"):
        w[name] = get(f"{projector}{name}.weight"), opt(f"{projector}{name}.bias")

    def put(x):
        return None if x is None else jax.device_put(np.asarray(x).astype(dtype), device)
    return jax.tree.map(put, w, is_leaf=lambda x: x is None)


def torch_linear(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    """x @ w.T (+ b), as torch's nn.Linear (w [out, in]), accumulated in f32."""
    y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
    return y if b is None else y + b.astype(jnp.float32)


def _layer(cfg: VisionConfig, x: jax.Array, lw: dict) -> jax.Array:
    """One encoder layer: x + attention(norm(x)), then + mlp(norm(.)); every position sees every other."""
    n, t, h = x.shape
    heads, dim = cfg.num_heads, h // cfg.num_heads
    y = layer_norm(x, lw["layer_norm1.weight"], cfg.eps, bias=lw["layer_norm1.bias"])

    def proj(p):
        out = torch_linear(y, lw[f"self_attn.{p}_proj.weight"], lw[f"self_attn.{p}_proj.bias"])
        return out.reshape(n, t, heads, dim)
    q, k, v = proj("q"), proj("k"), proj("v")
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k) * dim ** -0.5
    attn = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, t, h).astype(x.dtype)
    x = x + torch_linear(attn, lw["self_attn.out_proj.weight"], lw["self_attn.out_proj.bias"]).astype(x.dtype)
    y = layer_norm(x, lw["layer_norm2.weight"], cfg.eps, bias=lw["layer_norm2.bias"])
    y = named_activation(cfg.act, torch_linear(y, lw["mlp.fc1.weight"], lw["mlp.fc1.bias"])).astype(x.dtype)
    return x + torch_linear(y, lw["mlp.fc2.weight"], lw["mlp.fc2.bias"]).astype(x.dtype)


@functools.partial(jax.jit, static_argnums=0)
def image_features(cfg: VisionConfig, w: dict, pixels: jax.Array) -> jax.Array:
    """pixels f32[n, channels, size, size] (the image processor's pixel_values) -> [n, tokens_per_image,
    text hidden] in the weights' dtype."""
    dtype = w["patch"].dtype
    n, c, size, _ = pixels.shape
    p, g = cfg.patch_size, size // cfg.patch_size
    patches = pixels.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
    x = torch_linear(patches.astype(dtype), w["patch"].reshape(cfg.hidden_size, -1), w["patch_bias"])
    if w["class"] is not None:
        x = jnp.concatenate([jnp.broadcast_to(w["class"].astype(jnp.float32), (n, 1, cfg.hidden_size)), x], axis=1)
    x = (x + w["positions"].astype(jnp.float32)).astype(dtype)
    if w["pre_norm"][0] is not None:
        x = layer_norm(x, w["pre_norm"][0], cfg.eps, bias=w["pre_norm"][1])

    def step(h, lw):
        h = _layer(cfg, h, lw)
        return h, h
    states = [x]
    if cfg.num_layers:
        states += list(jax.lax.scan(step, x, w["layers"])[1])
    chosen = [states[i][:, int(cfg.drop_first):] for i in cfg.feature_layers]
    feats = jnp.concatenate(chosen, axis=-1)
    y = named_activation(cfg.projector_act, torch_linear(feats, *w["linear_1"])).astype(dtype)
    return torch_linear(y, *w["linear_2"]).astype(dtype)


class ImageTower:
    """What ImageInputs (engine/multimodal.py) asks of a vision tower on one device: LLaVA's (VisionTower) or
    Qwen2-VL's (models/qwen_vision.py). Its programs are compiled ahead of time (`warm_up` runs nothing), and
    the most memory one needs beside the weights is `reserve_bytes`, which the KV cache's sizing leaves free
    (engine/startup.py: the tower runs between steps, or beside one in flight)."""

    onevision = False            # LLaVA-OneVision: a prompt of several images gets their base tiles alone
    sized_by_processor = False   # compiled for the image processor's largest images (fit_processor, then warm_up)
    uses_mrope = False           # images turn the language model's rope by their rows and columns (`mrope`)

    def __init__(self, config: Any, weights: dict, device, dtype, image_token_id: int):
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = np.dtype(dtype)   # the rows' (the language model's activations)
        self.image_token_id = int(image_token_id)
        self._weight_bytes = sum(a.nbytes for a in jax.tree.leaves(weights))
        self._programs = {}      # key -> compiled program
        self.reserve_bytes = 0

    def fit_processor(self, processor) -> None:
        """Take the images `processor` makes (a tower compiled for one tile shape takes them all as they are)."""

    def _compiled(self, key, fn, *example):
        """`fn(config, weights, *args)` (a jit with config static) compiled for arguments shaped as `example`
        (host arrays), once per key; its memory beside the weights counted in reserve_bytes."""
        program = self._programs.get(key)
        if program is None:
            sharding = jax.sharding.SingleDeviceSharding(self.device)
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), example)
            program = self._programs[key] = fn.lower(self.config, self.weights, *shapes).compile()
            memory = program.memory_analysis()
            if memory is not None:
                self.reserve_bytes = max(self.reserve_bytes, memory.temp_size_in_bytes + memory.output_size_in_bytes
                                         + memory.argument_size_in_bytes - self._weight_bytes)
        return program


class VisionTower(ImageTower):
    """A LLaVA, LLaVA-NeXT or OneVision checkpoint's tower and projector, loaded onto one device: `image_rows`
    turns an image's pixel_values into the language model's input rows."""

    def __init__(self, hf_config: Any, get: Callable[[str], np.ndarray], has: Callable[[str], bool], dtype,
                 device):
        config = vision_config(hf_config)
        super().__init__(config, load_vision_weights(config, get, has, dtype, device), device, dtype,
                         getattr(hf_config, "image_token_id", None) or hf_config.image_token_index)
        self.grid_pinpoints = None   # LLaVA-NeXT, OneVision: the resolutions an image's grid of tiles may take
        self.max_tiles = None        # OneVision: a grid's features beyond about this many tiles' are downsized
        self.onevision = hf_config.architectures[0] == LLAVA_ONEVISION   # (which tiles a prompt of several images
        if hf_config.architectures[0] in (LLAVA_NEXT, LLAVA_ONEVISION):  # gets only its images' base tiles)
            self.grid_pinpoints = [list(p) for p in hf_config.image_grid_pinpoints]
            name = next(n for n in ("model.image_newline", "image_newline") if has(n))
            self.newline = np.asarray(get(name)).astype(dtype)   # ends each row of the grid's features
        if self.onevision:
            self.max_tiles = int(getattr(hf_config, "vision_aspect_ratio", "anyres_max_9").removeprefix("anyres_max_"))

    def _grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """LLaVA-NeXT: the rows and columns of tiles an image of `image_size` (height, width) takes."""
        from transformers.image_processing_utils import select_best_resolution
        height, width = select_best_resolution(image_size, self.grid_pinpoints)
        return height // self.config.image_size, width // self.config.image_size

    def _tiles(self, image_size: tuple[int, int], alone: bool) -> tuple[int, int]:
        """The grid an image's features take: (0, 0) for its base tile alone (a OneVision prompt of several)."""
        return self._grid(image_size) if alone or not self.onevision else (0, 0)

    def num_rows(self, image_size: tuple[int, int] | None = None, alone: bool = True) -> int:
        """How many rows (tokens) `image_rows` gives an image, without running the tower (its packing run on
        rows of width 1). `alone`: the prompt's only image."""
        per_tile = self.config.tokens_per_image
        if self.grid_pinpoints is None:
            return per_tile
        rows, cols = self._tiles(image_size, alone)
        dummy = np.zeros((1 + rows * cols, per_tile, 1), np.float32)
        return len(pack_tiles(dummy, rows, cols, image_size, np.zeros(1, np.float32), self.max_tiles))

    def image_rows(self, pixels: np.ndarray, image_size: tuple[int, int] | None = None,
                   alone: bool = True) -> np.ndarray:
        """One image's rows [tokens, text hidden]: pixel_values [channels, size, size] (LLaVA), or LLaVA-NeXT's
        and OneVision's [tiles, channels, size, size] (the whole image, then its grid) with the image's (height,
        width); `alone`: the prompt's only image (OneVision tiles no image of a prompt of several)."""
        if self.grid_pinpoints is None:
            return self.encode(pixels)
        rows, cols = self._tiles(image_size, alone)
        tiles = np.stack([self.encode(tile) for tile in pixels[:1 + rows * cols]])
        return pack_tiles(tiles, rows, cols, image_size, self.newline, self.max_tiles)

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        cfg = self.config
        return cfg.num_channels, cfg.image_size, cfg.image_size

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """f32[channels, size, size] -> [tokens_per_image, text hidden] in the model's dtype (on the host)."""
        if pixels.shape != self.pixel_shape:
            raise ValueError(f"the image processor gave pixel_values of shape {pixels.shape}; this vision tower "
                             f"takes {self.pixel_shape}")
        x = jax.device_put(np.asarray(pixels, np.float32)[None], self.device)
        return np.asarray(self._program()(self.weights, x)[0])

    def _program(self):
        return self._compiled("tile", image_features, np.zeros((1, *self.pixel_shape), np.float32))

    def warm_up(self) -> None:
        """Compile the one shape `encode` runs (engines compile nothing after start-up); nothing runs."""
        self._program()
