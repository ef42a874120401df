"""Reading and decoding one image a request names: a data URL, base64, a local file, or (with
--allow-remote-media) an http(s) URL. Every failure is a `MediaError` whose message names the part
(`what`) and the limit it broke; the HTTP layer answers 400 with it."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MIN_SIDE = 2  # pixels; a 1 x 1 image has no layout a processor can read (and is no picture)


class MediaError(ValueError):
    """A client's image cannot be used; the message names the part and why."""


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int
    max_pixels: int
    allow_remote: bool
    fetch_timeout: float


def load_image(src: object, what: str, limits: MediaLimits) -> Image.Image:
    """The image `src` names, decoded: a string (see read_source), `{"url": string}`, raw bytes, or
    (the Engine) a PIL image."""
    if isinstance(src, dict) and "url" in src:  # SGLang's ImageData shape, {"url": ...}
        src = src["url"]
    if isinstance(src, Image.Image):
        check_size(src, what, limits)
        return src
    data = src if isinstance(src, (bytes, bytearray)) else read_source(src, what, limits)
    if len(data) > limits.max_bytes:
        raise MediaError(
            f"{what}: the image has {len(data)} bytes, more than the limit of {limits.max_bytes} (--max-image-bytes)"
        )
    return decode_image(bytes(data), what, limits)


def read_source(src: object, what: str, limits: MediaLimits) -> bytes:
    """The encoded image bytes `src` names."""
    if not isinstance(src, str) or not src:
        raise MediaError(f"{what}: an image must be a non-empty string (a data URL, a URL, a file path or base64)")
    if src.startswith("data:"):
        header, sep, payload = src.partition(",")
        if not sep or not header.endswith(";base64"):
            raise MediaError(f"{what}: a data URL must read data:image/<format>;base64,<data>")
        if not header[5:].startswith("image/"):
            raise MediaError(f"{what}: the data URL's type {header[5:].removesuffix(';base64')!r} is not an image")
        return _b64(payload, what, limits)
    if src.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise MediaError(
                f"{what}: remote image URLs are not fetched by this server (start it with --allow-remote-media), "
                "send the image as a data URL or base64"
            )
        return _fetch(src, what, limits)
    path = src.removeprefix("file://")
    if len(path) < 4096 and os.path.isfile(path):
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise MediaError(
                f"{what}: the file has {size} bytes, more than the limit of {limits.max_bytes} (--max-image-bytes)"
            )
        with open(path, "rb") as f:
            return f.read()
    if src.startswith("file://") or src.startswith("/"):
        raise MediaError(f"{what}: no such file {path[:200]!r}")
    return _b64(src, what, limits)


def _b64(payload: str, what: str, limits: MediaLimits) -> bytes:
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise MediaError(
            f"{what}: the image has about {len(payload) * 3 // 4} bytes, more than the limit of {limits.max_bytes} "
            "(--max-image-bytes)"
        )
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(
            f"{what}: not valid base64 (nor a data URL, an http(s) URL or an existing file path)"
        ) from None


def _fetch(url: str, what: str, limits: MediaLimits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout) as r:  # noqa: S310 (http(s) only, above)
            data = r.read(limits.max_bytes + 1)
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
        raise MediaError(f"{what}: fetching {url[:200]} failed: {e}") from None
    if len(data) > limits.max_bytes:
        raise MediaError(
            f"{what}: {url[:200]} is larger than the limit of {limits.max_bytes} bytes (--max-image-bytes)"
        )
    return data


def decode_image(data: bytes, what: str, limits: MediaLimits) -> Image.Image:
    """The decoded image (fully read: a truncated file fails here, not in a processor)."""
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise MediaError(
            f"{what}: the image has more pixels than the limit of {limits.max_pixels} (--max-image-pixels)"
        ) from None
    except Exception:
        raise MediaError(f"{what}: not a readable image (supported: {', '.join(FORMATS)})") from None
    if img.format not in FORMATS:
        raise MediaError(f"{what}: image format {img.format} is not supported (supported: {', '.join(FORMATS)})")
    check_size(img, what, limits)
    try:
        img.load()
    except Exception as e:
        raise MediaError(f"{what}: the {img.format} data is corrupt or truncated ({e})") from None
    return img


def check_size(img: Image.Image, what: str, limits: MediaLimits) -> None:
    w, h = img.size
    if w * h > limits.max_pixels:
        raise MediaError(
            f"{what}: the image is {w} x {h} = {w * h} pixels, more than the limit of {limits.max_pixels} "
            "(--max-image-pixels)"
        )
    if min(w, h) < MIN_SIDE:
        raise MediaError(f"{what}: the image is {w} x {h}; each side must be at least {MIN_SIDE} pixels")
