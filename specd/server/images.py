"""Images in requests: each API's image parts read and bounded at the edge, decoded off the event loop.

A part is checked when the request is read (its shape, its base64, its encoded size, how many a
request holds), before any Model is asked for; an http(s) URL is fetched next (``fetch``), where
the daemon runs with ``--fetch-image-urls``, within ``MAX_IMAGE_BYTES`` and ``FETCH_SECONDS``; and
each is decoded with the prompt (``decode``, on the preparing thread): its format against the
media type it declared, its pixels against ``MAX_PIXELS`` before a byte of them is decompressed,
and its data whole. Each failure is a 400 naming the field; nothing here can hang or answer 500.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import warnings
from dataclasses import dataclass, replace

import aiohttp

from ..core.vision import pixel_digest
from .errors import bad_request

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # encoded, per image: what OpenAI's and Anthropic's APIs take
MAX_PIXELS = 7680 * 4320  # per image, width x height (8K); a decompression bomb is refused before decoding
MAX_IMAGES = 32  # per request
FETCH_SECONDS = 10.0  # an image URL's whole fetch, connecting included
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}
TEMPLATE_PART = {"type": "image"}  # what a chat template sees of an image


@dataclass(frozen=True)
class ImagePart:
    """An image as a request sent it: its bytes, the media type it declared, where it was."""

    data: bytes
    media_type: str
    where: str
    url: str | None = None  # an http(s) URL, fetched before decoding (``fetch``)


@dataclass(frozen=True)
class DecodedImage:
    image: object  # a PIL image, RGB, its pixels loaded
    digest: str  # its pixels hashed (``core.vision.pixel_digest``)


class ImageParts:
    """A request's images, in the order its messages hold them."""

    def __init__(self) -> None:
        self.parts: list[ImagePart] = []

    def add(self, part: ImagePart) -> dict:
        """Keep ``part``; returns what the chat template sees in its place."""
        if len(self.parts) == MAX_IMAGES:
            raise bad_request(f"a request may hold at most {MAX_IMAGES} images", part.where)
        self.parts.append(part)
        return dict(TEMPLATE_PART)

    def data_url(self, url: object, where: str) -> dict:
        """An OpenAI ``image_url`` (chat) or ``input_image`` (Responses) URL: a base64 data URL.
        A URL to fetch is refused: this daemon fetches nothing on a client's behalf."""
        if not isinstance(url, str):
            raise bad_request("an image URL must be a string", where)
        if url.startswith(("http://", "https://")):
            return self.link(url, where)
        head, comma, data = url.partition(",")
        if not (url.startswith("data:") and comma and head.endswith(";base64")):
            raise bad_request("an image URL must be a data:image/...;base64,... URL", where)
        media_type = head[len("data:"):].split(";")[0]
        if media_type and media_type not in MEDIA_TYPES:
            raise bad_request(f"media type {media_type!r} is not one of {', '.join(MEDIA_TYPES)}", where)
        return self.add(ImagePart(_base64(data, where), media_type, where))

    def link(self, url: str, where: str) -> dict:
        """An http(s) image URL, fetched later if the daemon fetches URLs at all."""
        if len(url) > 8192:
            raise bad_request("an image URL may be at most 8192 characters", where)
        return self.add(ImagePart(b"", "", where, url))

    def base64(self, data: object, media_type: object, where: str) -> dict:
        """An Anthropic ``image`` block's base64 source."""
        if not isinstance(media_type, str) or media_type not in MEDIA_TYPES:
            raise bad_request(f"media_type must be one of {', '.join(MEDIA_TYPES)}", f"{where}.media_type")
        if not isinstance(data, str):
            raise bad_request("data must be a base64 string", f"{where}.data")
        return self.add(ImagePart(_base64(data, f"{where}.data"), media_type, where))


class Content:
    """A message's content as a chat template takes it: its text, or where it holds images,
    its text and image parts in order."""

    def __init__(self) -> None:
        self.parts: list[dict] = []

    def text(self, text: str) -> None:
        if self.parts and self.parts[-1]["type"] == "text":
            self.parts[-1] = {"type": "text", "text": self.parts[-1]["text"] + text}
        else:
            self.parts.append({"type": "text", "text": text})

    def image(self, part: dict) -> None:
        self.parts.append(part)

    def value(self) -> str | list[dict]:
        if all(p["type"] == "text" for p in self.parts):
            return "".join(p["text"] for p in self.parts)
        return self.parts


def _base64(text: str, where: str) -> bytes:
    if len(text) > (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4:
        raise bad_request(f"the image is over {MAX_IMAGE_BYTES} bytes", where)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the image data is not valid base64", where) from None
    if not data:
        raise bad_request("the image data is empty", where)
    if len(data) > MAX_IMAGE_BYTES:
        raise bad_request(f"the image is over {MAX_IMAGE_BYTES} bytes", where)
    return data


async def fetch(parts: tuple[ImagePart, ...], allowed: bool) -> tuple[ImagePart, ...]:
    """``parts`` with each URL's bytes fetched (all at once), or a 400 naming the first that
    failed: fetching is off, the server answered other than 200, the body is over
    ``MAX_IMAGE_BYTES`` or took over ``FETCH_SECONDS``."""
    links = [part for part in parts if part.url is not None]
    if not links:
        return parts
    if not allowed:
        raise bad_request("this server does not fetch image URLs (its daemon runs without --fetch-image-urls); "
                          "send the image inline as a data:image/...;base64 URL", links[0].where)
    timeout = aiohttp.ClientTimeout(total=FETCH_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as session:
        fetched = await asyncio.gather(*(_fetch(session, part) for part in links), return_exceptions=True)
    for result in fetched:
        if isinstance(result, BaseException):
            raise result
    by_where = {part.where: part for part in fetched}
    return tuple(by_where.get(part.where, part) for part in parts)


async def _fetch(session: aiohttp.ClientSession, part: ImagePart) -> ImagePart:
    try:
        async with session.get(part.url, allow_redirects=True, max_redirects=3) as response:
            if response.status != 200:
                raise bad_request(f"fetching the image URL answered HTTP {response.status}", part.where)
            data = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise bad_request(f"the image is over {MAX_IMAGE_BYTES} bytes", part.where)
            media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
    except asyncio.TimeoutError:
        raise bad_request(f"fetching the image URL took over {FETCH_SECONDS:g} s", part.where) from None
    except (aiohttp.ClientError, ValueError) as exc:
        raise bad_request(f"the image URL could not be fetched: {type(exc).__name__}", part.where) from None
    if not data:
        raise bad_request("the image URL's body is empty", part.where)
    return replace(part, data=bytes(data), media_type=media_type if media_type in MEDIA_TYPES else "", url=None)


def decode(part: ImagePart) -> DecodedImage:
    """``part``'s pixels (CPU work: the preparing thread's), or a 400 naming its field."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(part.data), formats=list(MEDIA_TYPES.values())) as image:
                declared = MEDIA_TYPES.get(part.media_type)
                if declared is not None and image.format != declared:
                    raise bad_request(f"the image is {image.format} data, declared {part.media_type}", part.where)
                width, height = image.size
                if width * height > MAX_PIXELS:
                    raise bad_request(f"the image is {width}x{height} pixels; at most {MAX_PIXELS} are taken",
                                      part.where)
                image.seek(0)  # an animation: its first frame
                rgb = image.convert("RGB")
    except UnidentifiedImageError:
        raise bad_request(f"the image could not be decoded: it is not a {', '.join(MEDIA_TYPES.values())} image",
                          part.where) from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise bad_request(f"the image could not be decoded: {exc}", part.where) from None
    return DecodedImage(rgb, pixel_digest(rgb))
