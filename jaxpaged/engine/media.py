"""Images as users send them: PIL images, uint8 arrays, URLs (data:, http(s)://, file:// inside
allowed_local_media_path), in prompts' multi_modal_data and in chat messages' image parts (OpenAI's
`image_url`, vLLM's `image_pil` and `image`). An http(s) URL is fetched wherever it points, as vLLM's default
does. What a model does with them: engine/multimodal.py."""

import base64
import binascii
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


def square(image, mean):
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


_IMAGE_PARTS = ("image_url", "image_pil", "image", "image_embeds")


def chat_images(messages: list[dict], refused: str | None = None, local_root: str | None = None,
                embedded=None) -> tuple[list, list]:
    """Messages with image parts (OpenAI's {"type": "image_url", "image_url": {"url": ...}}, vLLM's
    {"type": "image_pil", "image_pil": img}, {"type": "image", "image": ...} and {"type": "image_embeds",
    "image_embeds": ...}) turned into the {"type": "image"} parts chat templates place their image token for, and
    the images in order; text-only messages unchanged. `refused`: why this engine takes no images (a ValueError
    naming the first image part), None: it does; `local_root`: the folder file:// URLs may read
    (allowed_local_media_path); `embedded(value, field)`: an image_embeds part's image (ImageInputs.embedded_part)."""
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
            images.append(embedded(image, field) if kind == "image_embeds" else load_image(image, field, local_root))
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
