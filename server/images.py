"""image_url parts -> ImageInput: fetch, decode under limits, preprocess.

Sources: `data:` URLs (images.data_urls, on by default); files under images.local_dir
(`file://` URLs or plain paths, symlinks and `..` resolved first, nothing outside it);
http(s) downloads when images.http is on (size, time and redirect limits). Formats: PNG,
JPEG, WebP and GIF (its first frame). Every refusal is a PromptError (HTTP 400) naming
the part, raised before any engine work. CPU and network work: callers run this in a
worker thread, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from urllib.parse import SplitResult, unquote, unquote_to_bytes, urlsplit

import httpx
from PIL import Image, ImageOps

from deltaserve.engine.types import ImageInput
from deltaserve.models.image_processor import ImageProcessorConfig, preprocess
from deltaserve.server.frontend.messages import ImageRef, PromptError
from deltaserve.server.settings import ImageSettings

FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}  # Pillow name -> ours


@functools.lru_cache(maxsize=4)
def processor_config(model_dir: Path) -> ImageProcessorConfig:
    """The checkpoint's image preprocessing settings, read once per directory."""
    return ImageProcessorConfig.from_dir(model_dir)


def load_images(
    refs: Sequence[ImageRef], settings: ImageSettings, processor: ImageProcessorConfig
) -> tuple[ImageInput, ...]:
    """Each referenced image, fetched, decoded and preprocessed, in order."""
    if len(refs) > settings.max_per_request:
        limit = settings.max_per_request
        message = f"a request may carry at most {limit} images; this one has {len(refs)}"
        raise PromptError(message, refs[limit].param)
    bound = min(processor.max_pixels, settings.max_resized_pixels)
    processor = replace(processor, max_pixels=bound, min_pixels=min(processor.min_pixels, bound))
    return tuple(load_image(ref, settings, processor) for ref in refs)


def load_image(
    ref: ImageRef, settings: ImageSettings, processor: ImageProcessorConfig
) -> ImageInput:
    """One image as the engine takes it; digest = sha256 of its patches and grid."""
    image = decode(fetch(ref, settings), ref.param, settings.max_pixels)
    try:
        patches, grid = preprocess(image, processor)
    except ValueError as error:  # e.g. an aspect ratio over 200:1
        raise PromptError(f"cannot use this image: {error}", ref.param) from None
    digest = hashlib.sha256(patches.data)
    digest.update(repr(grid).encode())
    return ImageInput(patches, grid, processor.num_tokens(grid), digest.hexdigest())


def fetch(ref: ImageRef, settings: ImageSettings) -> bytes:
    """The encoded image bytes behind `ref.url`, from a source the settings allow."""
    if ref.url[:5].lower() == "data:":
        if not settings.data_urls:
            raise PromptError("data: image URLs are not enabled on this server", ref.param)
        return _data_url(ref, settings.max_bytes)
    try:
        parts = urlsplit(ref.url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        raise PromptError("the image URL is malformed", ref.param) from None
    scheme = parts.scheme.lower()
    if scheme in ("", "file"):
        return _local_file(ref, parts, settings)
    if scheme in ("http", "https"):
        if not settings.http:
            raise PromptError(f"{scheme} image URLs are not enabled on this server", ref.param)
        return _download(ref, settings)
    raise PromptError(f"image URL scheme {scheme!r} is not supported", ref.param)


def decode(data: bytes, param: str, max_pixels: int) -> Image.Image:
    """A decoded PNG, JPEG, WebP or GIF (first frame), upright per its EXIF orientation.

    The size is checked from the header, before any pixel is decoded; Pillow's own
    decompression-bomb guard stays on behind it."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise PromptError("the image has too many pixels", param) from None
    except Exception:  # Pillow's plugins raise many types for bad headers
        raise PromptError("the data is not a readable image", param) from None
    if image.format not in FORMATS:
        supported = ", ".join(FORMATS.values())
        message = f"image format {image.format} is not supported (use {supported})"
        raise PromptError(message, param)
    width, height = image.size
    if width * height > max_pixels:
        message = f"the image is {width}x{height} pixels; at most {max_pixels} are allowed"
        raise PromptError(message, param)
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except Exception:  # truncated or corrupt pixel data (OSError, SyntaxError, ...)
        message = f"the {FORMATS[image.format]} image is corrupt or truncated"
        raise PromptError(message, param) from None


def _data_url(ref: ImageRef, max_bytes: int) -> bytes:
    header, comma, payload = ref.url[5:].partition(",")
    if not comma:
        raise PromptError("a data: URL needs a comma before its data", ref.param)
    if header.lower().endswith(";base64"):
        size = (len(payload) - payload[-2:].count("=")) * 3 // 4
        _check_size(size, max_bytes, ref.param)  # before decoding it
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise PromptError("the data: URL is not valid base64", ref.param) from None
    data = unquote_to_bytes(payload)
    _check_size(len(data), max_bytes, ref.param)
    return data


def _local_file(ref: ImageRef, parts: SplitResult, settings: ImageSettings) -> bytes:
    if not settings.local_dir:
        raise PromptError("local image files are not enabled on this server", ref.param)
    if parts.scheme and parts.netloc not in ("", "localhost"):
        raise PromptError("a file:// URL must name a local file", ref.param)
    root = Path(settings.local_dir).expanduser().resolve()
    try:
        # Symlinks and ".." resolved before the check; an absolute path replaces root.
        path = (root / unquote(parts.path if parts.scheme else ref.url)).resolve()
        is_inside, is_file = path.is_relative_to(root), path.is_file()
    except (OSError, ValueError, RuntimeError):  # NUL in the name, a symlink loop
        raise PromptError("the file name cannot be resolved", ref.param) from None
    if not is_inside:
        raise PromptError("the file is outside the server's image directory", ref.param)
    if not is_file:
        raise PromptError("no such file in the server's image directory", ref.param)
    try:
        with path.open("rb") as file:
            data = file.read(settings.max_bytes + 1)  # +1: tells "too large" from "just fits"
    except OSError:
        raise PromptError("the file cannot be read", ref.param) from None
    _check_size(len(data), settings.max_bytes, ref.param)
    return data


def _download(ref: ImageRef, settings: ImageSettings) -> bytes:
    """GET the URL, following at most http_max_redirects redirects (each to http(s)),
    within http_timeout seconds in all and max_bytes of body."""
    deadline = time.monotonic() + settings.http_timeout
    try:
        url = httpx.URL(ref.url)
        with httpx.Client(timeout=settings.http_timeout, follow_redirects=False) as client:
            for _ in range(settings.http_max_redirects + 1):
                remaining = max(0.01, deadline - time.monotonic())
                with client.stream("GET", url, timeout=remaining) as response:
                    if not response.is_redirect:
                        return _read_body(response, ref.param, settings.max_bytes, deadline)
                    url = url.join(response.headers.get("location", ""))
                if url.scheme not in ("http", "https"):
                    raise PromptError("the image URL redirects off http(s)", ref.param)
    except httpx.TimeoutException:
        raise PromptError("downloading the image timed out", ref.param) from None
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        message = f"downloading the image failed ({type(error).__name__})"
        raise PromptError(message, ref.param) from None
    raise PromptError("the image URL redirects too many times", ref.param)


def _read_body(response: httpx.Response, param: str, max_bytes: int, deadline: float) -> bytes:
    if response.status_code != 200:
        raise PromptError(f"downloading the image failed: HTTP {response.status_code}", param)
    length = response.headers.get("content-length", "")
    if length.isdigit():
        _check_size(int(length), max_bytes, param)
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        _check_size(len(body), max_bytes, param)
        if time.monotonic() > deadline:
            raise PromptError("downloading the image timed out", param)
    return bytes(body)


def _check_size(num_bytes: int, max_bytes: int, param: str) -> None:
    if num_bytes > max_bytes:
        raise PromptError(f"the image is over {max_bytes} bytes", param)
