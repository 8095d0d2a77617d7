"""Images in prompts, as vLLM takes them: `{"prompt": ..., "multi_modal_data": {"image": image or [images]},
"mm_processor_kwargs": {...}}` and chat messages' image parts (read as engine/media.py says).

For a LLaVA, LLaVA-NeXT or OneVision checkpoint (models/vision.py), or a Qwen2-VL or Qwen2.5-VL one
(models/qwen_vision.py): each image's placeholder token in the prompt (`<image>`, `<|image_pad|>`, once or already
repeated) stands for as many tokens as the tower gives rows; the checkpoint's own
image processor (transformers', on PIL) makes its pixel_values, the tower its rows, and the step reads those rows
where the prompt holds the image's tokens (Request.embed_ranges). Each block's hash takes a digest of the images
it holds, so the prefix cache shares blocks only between the same images at the same places. Qwen's images
turn the language model's rope by their rows and columns (M-RoPE: Request.mrope_offsets)."""

import asyncio
import collections
import dataclasses
import hashlib
import json
import os
import threading

import numpy as np

from jaxpaged.engine.media import image_list, load_image, square
from jaxpaged.engine.prompt_embeds import as_embeds, decode_base64, host_array


def takes_images(args, loaded) -> bool:
    """Whether an engine runs its requests' images (its steps then take rows in place of tokens)."""
    return loaded.vision is not None and args.num_nodes == 1 and args.runner != "pooling" and \
        (args.limit_mm_per_prompt or {}).get("image") != 0


def image_inputs(args, loaded, tokenizer) -> tuple["ImageInputs | None", str]:
    """An engine's ImageInputs (its vision tower compiled unless compile_on_startup is off), or None and why
    its requests' images are refused."""
    arch = (getattr(loaded.hf_config, "architectures", None) or ["this model"])[0]
    if loaded.vision is None:
        from jaxpaged.models.vision_language import is_vision_language
        return None, (f"{arch} runs its language model alone here (its vision tower is not supported yet, or "
                      "the checkpoint was converted without it)" if is_vision_language(loaded.hf_config)
                      else f"{arch} takes text only")
    limit = (args.limit_mm_per_prompt or {}).get("image")
    if not takes_images(args, loaded):
        return None, ("images are not supported across several hosts (num_nodes > 1)" if args.num_nodes > 1
                      else "images are not supported with runner='pooling'" if args.runner == "pooling"
                      else "limit_mm_per_prompt={'image': 0} allows none")
    folder = loaded.source if os.path.isdir(loaded.source) else None
    images = ImageInputs(loaded.vision, folder, args.block_size, tokenizer, limit, args.allowed_local_media_path,
                         args.mm_processor_kwargs, loaded.config.hidden_size if args.enable_mm_embeds else None)
    if args.compile_on_startup and _sized(images):
        loaded.vision.warm_up()
    return images, ""


def _sized(images: "ImageInputs") -> bool:
    """Whether the tower knows the images it will take: a Qwen2-VL tower, compiled for its image processor's
    largest ones, once that processor loads (a folder without one: images are refused when sent, saying so; a bad
    mm_processor_kwargs: a ValueError now)."""
    if not images.tower.sized_by_processor:
        return True
    if not images.has_processor:
        return False
    images.processor()
    return True


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """An image as its checkpoint's processor made it: what the tower reads, and the prefix cache's digest."""
    pixels: np.ndarray | None      # pixel_values of the image (LLaVA-NeXT: its tiles; Qwen2-VL: its patches)
    size: tuple[int, ...] | None   # LLaVA-NeXT: the image's (height, width); Qwen2-VL: its grid (t, h, w)
    digest: bytes
    rows: np.ndarray | None = None   # image embeddings given (enable_mm_embeds): the tower's rows, not run


async def prepare_images(engine, prompt):
    """`ImageInputs.prepare_prompt` in a worker thread, for an engine that takes images (else the prompt)."""
    images = engine.replicas()[0].input_processor.images
    if images is None or not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return prompt
    return await asyncio.to_thread(images.prepare_prompt, prompt)


class ImageInputs:
    """What an engine with a vision tower does to a prompt's images (InputProcessor.process)."""

    CACHE_BYTES = 256 << 20   # the rows of recent images are kept up to this size (a conversation sends its
    # image again: LLaVA-1.5's rows are 4.5 MiB in bfloat16, LLaVA-NeXT's up to 5 times that)

    def __init__(self, tower, folder: str | None, block_size: int, tokenizer=None, limit: int | None = None,
                 local_root: str | None = None, processor_kwargs: dict | None = None, embeds_width: int | None = None):
        self.tower = tower
        self.embeds_width = embeds_width   # enable_mm_embeds: the rows' width (the model's hidden size); None: off
        self.local_root = local_root   # allowed_local_media_path: the folder file:// URLs may read
        self.limit = limit   # limit_mm_per_prompt's: a prompt's most images (None: no bound)
        self.folder = folder
        self.block_size = block_size
        self.placeholder = tokenizer.convert_ids_to_tokens(tower.image_token_id) if tokenizer is not None else None
        self._processor = None
        self.processor_kwargs = processor_kwargs or {}   # mm_processor_kwargs: the image processor's overrides
        self._request_processors = collections.OrderedDict()   # a request's mm_processor_kwargs (JSON) -> its
        self._lock = threading.Lock()   # processor, the latest used last (prompts are prepared in worker threads)
        self._rows = collections.OrderedDict()   # image digest -> rows, the latest used last
        self._rows_bytes = 0

    @property
    def has_processor(self) -> bool:
        return self.folder is not None and os.path.exists(os.path.join(self.folder, "preprocessor_config.json"))

    def processor(self, kwargs: dict | None = None):
        """The checkpoint's image processor, made with the engine's mm_processor_kwargs; with a request's
        `kwargs` over them, one made for those (the latest few kept). The tower takes the engine's images: a
        request's larger ones are refused when the tower sees them."""
        if kwargs is not None and kwargs != {}:   # (a value that is no dict: refused there)
            return self._request_processor(kwargs)
        if self._processor is None:
            processor = self._load(self.processor_kwargs, "")
            self.tower.fit_processor(processor)
            self._processor = processor
        return self._processor

    def _load(self, kwargs: dict, whose: str):
        if not self.has_processor:
            raise ValueError("images need the checkpoint's image processor (preprocessor_config.json), which "
                             "this model folder does not have")
        from transformers import AutoImageProcessor
        try:
            return AutoImageProcessor.from_pretrained(self.folder, backend="pil", **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mm_processor_kwargs {kwargs}{whose}: the image processor refuses them ({e})") from None

    def _request_processor(self, kwargs):
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"mm_processor_kwargs must be a dict of the image processor's arguments (such as "
                             f"{{'max_pixels': 401408}}), got {type(kwargs).__name__}")
        try:
            key = json.dumps(kwargs, sort_keys=True)
        except (TypeError, ValueError):
            raise ValueError(f"mm_processor_kwargs must hold JSON values (numbers, strings, lists, dicts), got "
                             f"{kwargs!r:.200}") from None
        self.processor()   # (the engine's first: the tower is fit to it)
        with self._lock:
            processor = self._request_processors.pop(key, None)
        if processor is None:
            processor = self._load({**self.processor_kwargs, **kwargs}, " (the request's over the engine's)")
        with self._lock:
            self._request_processors[key] = processor
            while len(self._request_processors) > 8:
                self._request_processors.popitem(last=False)
        return processor

    def prepare(self, image, field: str, alone: bool = True, kwargs: dict | None = None) -> PreparedImage:
        """An image read and made pixel_values by the checkpoint's processor (the work before the tower);
        `alone`: the prompt's only image (OneVision pads one of several to a square, its base tile alone);
        `kwargs`: the request's mm_processor_kwargs."""
        if isinstance(image, PreparedImage):
            return image
        image = load_image(image, field, self.local_root)
        processor = self.processor(kwargs)
        if self.tower.onevision and not alone:
            image = square(image, processor.image_mean)
        try:
            out = processor(images=[image], return_tensors="np")
        except Exception as e:   # (transformers' processors raise many kinds for an image they cannot size)
            given = f" with mm_processor_kwargs {kwargs}" if kwargs else ""
            raise ValueError(f"{field}: the checkpoint's image processor cannot process it{given} "
                             f"({type(e).__name__}: {e})") from None
        pixels = out["pixel_values"]   # (one image's: Qwen2-VL's patches are not batched by image)
        pixels = np.asarray(pixels if "image_grid_thw" in out else pixels[0], np.float32)
        # LLaVA-NeXT: the image's (height, width), which shapes its grid; Qwen2-VL: the grid of its patches
        size = out.get("image_sizes", out.get("image_grid_thw"))
        size = None if size is None else tuple(int(v) for v in size[0])
        return PreparedImage(pixels, size, hashlib.sha256(pixels.tobytes() + repr(size).encode()).digest())

    def prepare_prompt(self, prompt):
        """The prompt with its multi_modal_data's images prepared (AsyncLLM runs this off the engine's thread,
        which then only runs the tower); a prompt without images, or one with bad images, as it is (the
        engine's InputProcessor names what is wrong)."""
        if not isinstance(prompt, dict) or not isinstance(prompt.get("multi_modal_data"), dict):
            return prompt
        try:
            images = self.embedded(image_list(prompt["multi_modal_data"]))
            images = [self.prepare(image, f"multi_modal_data['image'][{i}]", len(images) == 1,
                                   prompt.get("mm_processor_kwargs")) for i, image in enumerate(images)]
        except ValueError:
            return prompt
        return {**prompt, "multi_modal_data": {"image": images}}

    def embedded_part(self, value, field: str) -> PreparedImage:
        """A chat message's image_embeds part, one image: vLLM's base64 of torch.save(tensor) (or of a .npy file),
        for Qwen2-VL a dict of them ({"image_embeds", "image_grid_thw"}), or the arrays themselves (LLM.chat)."""
        def decoded(v, name):   # (any numbers: embedded()'s own checks decide, as for arrays given in Python)
            return decode_base64(v, name, "fiu") if isinstance(v, str) else v
        if self.embeds_width is None:
            raise ValueError(f"{field} is image embeddings: they need an engine built with enable_mm_embeds=True "
                             "(--enable-mm-embeds)")
        entry = {k: decoded(v, f"{field}['image_embeds'][{k!r}]") for k, v in value.items()} \
            if isinstance(value, dict) else {"image_embeds": decoded(value, f"{field}['image_embeds']")}
        out = self.embedded([entry], field)
        if len(out) != 1:
            raise ValueError(f"{field} must hold one image's embeddings (a part per image), got {len(out)} images")
        return out[0]

    def embedded(self, images: list, field: str = "multi_modal_data['image']") -> list:
        """multi_modal_data's images with vLLM's image embeddings (a dict) made PreparedImages, one per image:
        {"image_embeds": [images,] tokens x hidden} for LLaVA's towers (or that array alone, a torch tensor or a
        float array: no image is one), {"image_embeds": [tokens, hidden], "image_grid_thw": [images, 3]} for
        Qwen2-VL's (the grids turn the rope). Needs enable_mm_embeds."""
        out = []
        for i, entry in enumerate(images):
            bare = hasattr(entry, "detach") or (isinstance(entry, np.ndarray) and entry.dtype.kind == "f")
            if bare and self.embeds_width is not None:   # (without the flag: read as an image, refused as one)
                entry = {"image_embeds": entry}
            if not isinstance(entry, dict):
                out.append(entry)
                continue
            name = field + (f"[{i}]" if len(images) > 1 else "")
            if self.embeds_width is None:
                raise ValueError(f"{name}: image embeddings need an engine built with enable_mm_embeds=True "
                                 "(--enable-mm-embeds)")
            keys = ("image_embeds", "image_grid_thw") if self.tower.uses_mrope else ("image_embeds",)
            if set(entry) != set(keys):
                raise ValueError(f"{name} must be a dict with keys {list(keys)} (this model's image embeddings), "
                                 f"got {sorted(map(str, entry))}")
            out += self._embeds(entry, name)
        return out

    def _embeds(self, entry: dict, field: str) -> list[PreparedImage]:
        dtype, name = self.tower.dtype, field + "['image_embeds']"
        if not self.tower.uses_mrope:
            value = host_array(entry["image_embeds"], name)
            parts = list(value) if value.ndim == 3 else [value]
            return [self._embedded_image(as_embeds(p, self.embeds_width, dtype, name), None) for p in parts]
        rows = as_embeds(entry["image_embeds"], self.embeds_width, dtype, name)
        grids = host_array(entry["image_grid_thw"], field + "['image_grid_thw']")
        if grids.ndim != 2 or grids.shape[1] != 3 or grids.dtype.kind not in "iu" or (grids < 1).any():
            raise ValueError(f"{field}['image_grid_thw'] must be positive integers [images, 3] (t, h, w patches), "
                             f"got {grids.dtype} {list(grids.shape)}")
        grids = [tuple(int(v) for v in g) for g in grids]
        counts = [self.tower.num_rows(g) for g in grids]
        if sum(counts) != len(rows) or any(g[0] != 1 for g in grids):
            raise ValueError(f"{field}: image_grid_thw {grids} gives {sum(counts)} rows (a frame each), "
                             f"image_embeds has {len(rows)}")
        ends = np.cumsum(counts)
        return [self._embedded_image(rows[end - n:end], g) for g, n, end in zip(grids, counts, ends)]

    @staticmethod
    def _embedded_image(rows: np.ndarray, grid) -> PreparedImage:
        digest = hashlib.sha256(b"embeds" + rows.tobytes() + repr(grid).encode()).digest()
        return PreparedImage(None, grid, digest, rows)

    def rows(self, image: PreparedImage, alone: bool = True) -> tuple[bytes, np.ndarray]:
        """(digest of its pixel_values, its rows [tokens, hidden]); `alone`: the prompt's only image (OneVision
        tiles only such an image, so its rows, and their digest, depend on it)."""
        if image.rows is not None:   # embeddings given
            return image.digest, image.rows
        digest = image.digest
        if self.tower.onevision:
            digest = hashlib.sha256(digest + bytes([alone])).digest()
        rows = self._rows.pop(digest, None)
        if rows is None:
            rows = self.tower.image_rows(image.pixels, image.size, alone)
            self._rows_bytes += rows.nbytes
        self._rows[digest] = rows
        while self._rows_bytes > self.CACHE_BYTES and len(self._rows) > 1:
            self._rows_bytes -= self._rows.popitem(last=False)[1].nbytes
        return digest, rows

    def expand(self, token_ids: list[int], counts: list[int]) -> tuple[list[int], list[int]]:
        """The prompt with each image's placeholder repeated as many times as the image has rows (`counts`), and
        where each image's tokens begin. The prompt holds one placeholder per image, or (already expanded) each
        image's count in a row."""
        image_id = self.tower.image_token_id
        found = [i for i, t in enumerate(token_ids) if t == image_id]
        if len(found) == len(counts):   # one each
            out, starts = [], []
            for t in token_ids:
                if t == image_id:
                    starts.append(len(out))
                out += [t] * (counts[len(starts) - 1] if t == image_id else 1)
            return out, starts
        firsts = np.cumsum([0] + counts[:-1]).tolist()
        if len(found) != sum(counts) or any(found[k + n - 1] != found[k] + n - 1 for k, n in zip(firsts, counts)):
            raise ValueError(f"the prompt has {len(found)} image token(s) ({self.placeholder!r}) for {len(counts)} "
                             f"image(s) in multi_modal_data['image']: put one placeholder per image (or as many "
                             f"in a row as the image has tokens: {', '.join(map(str, counts))})")
        return list(token_ids), [found[k] for k in firsts]

    def expanded(self, token_ids: list[int], images: list,
                 kwargs: dict | None = None) -> tuple[list[int], list[PreparedImage]]:
        """A rendered conversation's token ids with each image's placeholder expanded, and its images prepared
        (the server's: its context-length check and /tokenize count the tokens the model sees); `kwargs`: the
        request's mm_processor_kwargs."""
        prepared = [self.prepare(image, f"the conversation's image {i}", len(images) == 1, kwargs)
                    for i, image in enumerate(images)]
        counts = [len(p.rows) if p.rows is not None else self.tower.num_rows(p.size, len(prepared) == 1)
                  for p in prepared]
        return self.expand(token_ids, counts)[0], prepared

    def process(self, token_ids: list[int], images: list, truncate,
                kwargs: dict | None = None) -> tuple[list[int], tuple, tuple, tuple | None]:
        """(token ids, ((first position, rows), ...), each block's digest or None, M-RoPE's (offsets, delta) or
        None) of a prompt and its images; `truncate`: the prompt's truncation (InputProcessor.truncate), which
        must not cut into an image; `kwargs`: the prompt's mm_processor_kwargs."""
        images = self.embedded(images)
        if self.limit is not None and len(images) > self.limit:
            raise ValueError(f"multi_modal_data['image'] holds {len(images)} images; this engine's "
                             f"limit_mm_per_prompt allows {self.limit} (LLM(..., limit_mm_per_prompt={{'image': N}}))")
        images = [self.prepare(image, f"multi_modal_data['image'][{i}]", len(images) == 1, kwargs)
                  for i, image in enumerate(images)]
        found = sum(t == self.tower.image_token_id for t in token_ids)
        if found < len(images):   # (before the tower runs)
            raise ValueError(f"the prompt has {found} image token(s) ({self.placeholder!r}) for {len(images)} "
                             f"image(s) in multi_modal_data['image']: put one placeholder per image")
        digests, rows = zip(*(self.rows(image, len(images) == 1) for image in images))
        expanded, starts = self.expand(token_ids, [len(r) for r in rows])
        kept = truncate(expanded)
        cut = len(expanded) - len(kept)
        if any(s < cut < s + len(r) for s, r in zip(starts, rows)):
            raise ValueError("truncate_prompt_tokens would cut into an image's tokens; keep more tokens")
        kept_images = [(s - cut, r, d, i.size) for s, r, d, i in zip(starts, rows, digests, images) if s >= cut]
        ranges = [(s, r) for s, r, _, _ in kept_images]
        mrope = None
        if self.tower.uses_mrope and kept_images:   # Qwen2-VL: the rope turns each image's rows and columns
            mrope = self.tower.mrope(len(kept), [(s, size) for s, _, _, size in kept_images])
        return kept, tuple(ranges), self.block_digests(ranges, [d for _, _, d, _ in kept_images]), mrope

    def block_digests(self, ranges: list, digests: list[bytes]) -> tuple:
        """Per block: a SHA-256 of the images it holds (which, and which of their tokens), None for a block of
        text alone (hashed as any text block is)."""
        bs = self.block_size
        end = max((start + len(rows) for start, rows in ranges), default=0)
        out = []
        for b in range(0, end, bs):
            parts = [digest + np.asarray([max(b, s) - s, min(b + bs, s + len(rows)) - s], np.int64).tobytes()
                     for (s, rows), digest in zip(ranges, digests) if s < b + bs and b < s + len(rows)]
            out.append(hashlib.sha256(b"".join(parts)).digest() if parts else None)
        return tuple(out)
