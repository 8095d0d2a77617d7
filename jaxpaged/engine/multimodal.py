"""Images in prompts, as vLLM takes them: `{"prompt": ..., "multi_modal_data": {"image": image or [images]}}`
(PIL images, uint8 arrays [height, width, 3], or URLs: data:, http(s), file:// inside allowed_local_media_path),
and chat messages' `image_url` parts. An http(s) URL is fetched wherever it points, as vLLM's default does.

For a LLaVA, LLaVA-NeXT or OneVision checkpoint (models/vision.py), or a Qwen2-VL or Qwen2.5-VL one
(models/qwen_vision.py): each image's placeholder token in the prompt (`<image>`, `<|image_pad|>`, once or already
repeated) stands for as many tokens as the tower gives rows; the checkpoint's own
image processor (transformers', on PIL) makes its pixel_values, the tower its rows, and the step reads those rows
where the prompt holds the image's tokens (Request.embed_ranges). Each block's hash takes a digest of the images
it holds, so the prefix cache shares blocks only between the same images at the same places. Qwen's images
turn the language model's rope by their rows and columns (M-RoPE: Request.mrope_offsets)."""

import asyncio
import base64
import binascii
import collections
import dataclasses
import hashlib
import io
import os
import urllib.parse
import urllib.request

import numpy as np

_MAX_IMAGE_BYTES = 20 << 20   # an image URL's body (http(s) or data:) beyond this is refused
_FETCH_TIMEOUT_S = 10


def _pil():
    try:
        import PIL.Image
    except ImportError as e:   # (a runtime install has it: pillow is one of jaxpaged's dependencies)
        raise ValueError("images need Pillow (pip install pillow)") from e
    return PIL.Image


def load_image(image, field: str = "multi_modal_data['image']", local_root: str | None = None):
    """A PIL image (RGB) from what a user may pass: a PIL image, a uint8 array [height, width, 3 or 4], or a
    URL string (data:image/...;base64, http(s)://, or file:// under `local_root`: allowed_local_media_path).
    ValueError naming `field` for anything else."""
    Image = _pil()
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in (3, 4):
            raise ValueError(f"{field}: an image array must be uint8 [height, width, 3 or 4], got {image.dtype} "
                             f"{list(image.shape)}")
        return Image.fromarray(image).convert("RGB")
    if isinstance(image, str):
        return _decode(_url_bytes(image, field, local_root), field)
    raise ValueError(f"{field} must be a PIL image, a uint8 array [height, width, 3] or an image URL (data: or "
                     f"http(s)://), got {type(image).__name__}")


def _url_bytes(url: str, field: str, local_root: str | None = None) -> bytes:
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64") or not head[len("data:"):].startswith("image/"):
            raise ValueError(f"{field}: a data URL must be data:image/<format>;base64,<data>")
        if len(payload) > _MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"{field}: the image is larger than {_MAX_IMAGE_BYTES >> 20} MiB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{field}: the data URL is not valid base64 ({e})") from None
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as response:
                body = response.read(_MAX_IMAGE_BYTES + 1)
        except (OSError, ValueError) as e:
            raise ValueError(f"{field}: could not fetch {url!r} ({e})") from None
        if len(body) > _MAX_IMAGE_BYTES:
            raise ValueError(f"{field}: the image at {url!r} is larger than {_MAX_IMAGE_BYTES >> 20} MiB")
        return body
    if url.startswith("file://"):
        return _local_file(url, field, local_root)
    raise ValueError(f"{field}: an image URL must start with data:image/ or http(s):// (file:// with "
                     f"allowed_local_media_path), got {url[:40]!r}")


def _local_file(url: str, field: str, local_root: str | None) -> bytes:
    """A file:// URL's bytes, read only inside `local_root` (vLLM's allowed_local_media_path)."""
    if local_root is None:
        raise ValueError(f"{field}: file:// URLs need allowed_local_media_path (--allowed-local-media-path DIR), "
                         "the folder they may be read from")
    path, root = os.path.realpath(urllib.parse.unquote(url[len("file://"):])), os.path.realpath(local_root)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"{field}: {url[:80]!r} is outside allowed_local_media_path {local_root!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{field}: no file at {url[:80]!r}")
    if os.path.getsize(path) > _MAX_IMAGE_BYTES:
        raise ValueError(f"{field}: the image at {url[:80]!r} is larger than {_MAX_IMAGE_BYTES >> 20} MiB")
    with open(path, "rb") as f:
        return f.read()


def _decode(data: bytes, field: str):
    Image = _pil()
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:   # PIL raises many kinds for bytes that are not an image it reads
        raise ValueError(f"{field}: not an image Pillow can read ({type(e).__name__}: {e})") from None
    return image.convert("RGB")


def _square(image, mean):
    """The image centred on a square of the processor's mean colour (OneVision's pad_to_square)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = _pil().new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def image_list(data, field: str = "multi_modal_data") -> list:
    """multi_modal_data's images, as a list (one image or several); ValueError for another modality."""
    if not isinstance(data, dict):
        raise ValueError(f"{field} must be a dict such as {{'image': image}}, got {type(data).__name__}")
    other = sorted(set(data) - {"image"})
    if other:
        raise ValueError(f"{field} has {other}; allowed: ['image'] (images are the only modality supported)")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images or any(i is None for i in images):
        raise ValueError(f"{field}['image'] must be an image or a non-empty list of images")
    return images


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
                         args.mm_processor_kwargs)
    if args.compile_on_startup and _sized(images):
        loaded.vision.warm_up()
    return images, ""


def _sized(images: "ImageInputs") -> bool:
    """Whether the tower knows the images it will take: a Qwen2-VL tower, compiled for its image processor's
    largest ones, once that processor loads (a folder without one: images are refused when sent, saying so; a bad
    mm_processor_kwargs: a ValueError now)."""
    if not hasattr(images.tower, "fit_processor"):
        return True
    if not images.has_processor:
        return False
    images.processor()
    return True


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """An image as its checkpoint's processor made it: what the tower reads, and the prefix cache's digest."""
    pixels: np.ndarray             # pixel_values of the image (LLaVA-NeXT: its tiles; Qwen2-VL: its patches)
    size: tuple[int, ...] | None   # LLaVA-NeXT: the image's (height, width); Qwen2-VL: its grid (t, h, w)
    digest: bytes


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
                 local_root: str | None = None, processor_kwargs: dict | None = None):
        self.tower = tower
        self.local_root = local_root   # allowed_local_media_path: the folder file:// URLs may read
        self.limit = limit   # limit_mm_per_prompt's: a prompt's most images (None: no bound)
        self.folder = folder
        self.block_size = block_size
        self.placeholder = tokenizer.convert_ids_to_tokens(tower.image_token_id) if tokenizer is not None else None
        self._processor = None
        self.processor_kwargs = processor_kwargs or {}   # mm_processor_kwargs: the image processor's overrides
        self._rows = collections.OrderedDict()   # image digest -> rows, the latest used last
        self._rows_bytes = 0

    @property
    def has_processor(self) -> bool:
        return self.folder is not None and os.path.exists(os.path.join(self.folder, "preprocessor_config.json"))

    def processor(self):
        if self._processor is None:
            if not self.has_processor:
                raise ValueError("images need the checkpoint's image processor (preprocessor_config.json), which "
                                 "this model folder does not have")
            from transformers import AutoImageProcessor
            try:
                processor = AutoImageProcessor.from_pretrained(self.folder, backend="pil", **self.processor_kwargs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"mm_processor_kwargs {self.processor_kwargs}: the image processor refuses them "
                                 f"({e})") from None
            if hasattr(self.tower, "fit_processor"):
                self.tower.fit_processor(processor)
            self._processor = processor
        return self._processor

    def prepare(self, image, field: str, alone: bool = True) -> PreparedImage:
        """An image read and made pixel_values by the checkpoint's processor (the work before the tower);
        `alone`: the prompt's only image (OneVision pads one of several to a square, its base tile alone)."""
        if isinstance(image, PreparedImage):
            return image
        image = load_image(image, field, self.local_root)
        if self.tower.onevision and not alone:
            image = _square(image, self.processor().image_mean)
        try:
            out = self.processor()(images=[image], return_tensors="np")
        except Exception as e:   # (transformers' processors raise many kinds for an image they cannot size)
            raise ValueError(f"{field}: the checkpoint's image processor cannot process it "
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
            images = image_list(prompt["multi_modal_data"])
            images = [self.prepare(image, f"multi_modal_data['image'][{i}]", len(images) == 1)
                      for i, image in enumerate(images)]
        except ValueError:
            return prompt
        return {**prompt, "multi_modal_data": {"image": images}}

    def rows(self, image: PreparedImage, alone: bool = True) -> tuple[bytes, np.ndarray]:
        """(digest of its pixel_values, its rows [tokens, hidden]); `alone`: the prompt's only image (OneVision
        tiles only such an image, so its rows, and their digest, depend on it)."""
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

    def expanded(self, token_ids: list[int], images: list) -> tuple[list[int], list[PreparedImage]]:
        """A rendered conversation's token ids with each image's placeholder expanded, and its images prepared
        (the server's: its context-length check and /tokenize count the tokens the model sees)."""
        prepared = [self.prepare(image, f"the conversation's image {i}", len(images) == 1)
                    for i, image in enumerate(images)]
        counts = [self.tower.num_rows(p.size, len(prepared) == 1) for p in prepared]
        return self.expand(token_ids, counts)[0], prepared

    def process(self, token_ids: list[int], images: list, truncate) -> tuple[list[int], tuple, tuple, tuple | None]:
        """(token ids, ((first position, rows), ...), each block's digest or None, M-RoPE's (offsets, delta) or
        None) of a prompt and its images; `truncate`: the prompt's truncation (InputProcessor.truncate), which
        must not cut into an image."""
        if self.limit is not None and len(images) > self.limit:
            raise ValueError(f"multi_modal_data['image'] holds {len(images)} images; this engine's "
                             f"limit_mm_per_prompt allows {self.limit} (LLM(..., limit_mm_per_prompt={{'image': N}}))")
        images = [self.prepare(image, f"multi_modal_data['image'][{i}]", len(images) == 1)
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
        if hasattr(self.tower, "mrope") and kept_images:   # Qwen2-VL: the rope turns each image's rows and columns
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


_IMAGE_PARTS = ("image_url", "image_pil", "image")


def chat_images(messages: list[dict], refused: str | None = None, local_root: str | None = None) -> tuple[list, list]:
    """Messages with image parts (OpenAI's {"type": "image_url", "image_url": {"url": ...}}, vLLM's
    {"type": "image_pil", "image_pil": img} and {"type": "image", "image": ...}) turned into the {"type": "image"}
    parts chat templates place their image token for, and the images in order; text-only messages unchanged.
    `refused`: why this engine takes no images (a ValueError naming the first image part), None: it does;
    `local_root`: the folder file:// URLs may read (allowed_local_media_path)."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _IMAGE_PARTS:
                parts.append(part)
                continue
            field = f"messages[{i}].content[{j}]"
            if refused is not None:
                raise ValueError(f"{field} is an image ({kind!r}) and {refused}")
            image = part.get(kind)
            if kind == "image_url" and isinstance(image, dict):
                image = image.get("url")
            if image is None:
                raise ValueError(f"{field}: an {kind!r} part needs its image in {kind!r}")
            images.append(load_image(image, field, local_root))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def text_content(messages: list[dict], placeholder: str) -> list[dict]:
    """Messages with image parts as one string each: a placeholder per image, then the text parts."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            images = "".join(placeholder + "\n" for p in content if p.get("type") == "image")
            content = images + "\n".join(p.get("text", "") for p in content if p.get("type") != "image")
            message = {**message, "content": content}
        out.append(message)
    return out
