"""Reading request bodies that may be hostile: bounded in size, charset,
nesting and number length, so a bad body is a 4xx and never a 500 or a stall.

aiohttp enforces the size (``client_max_size``: 413); these checks keep the
JSON decoder's own failures (a 100k-deep nesting overflows its recursion, a
5,000-digit integer exceeds Python's conversion limit) inside the request.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ..api.text import LONE_SURROGATE, lone_surrogate_path

MAX_JSON_DEPTH = 64  # an OpenAI body with tools and JSON schemas nests about 10 deep
UTF8 = ("utf-8", "utf8")


class BodyError(Exception):
    """A body that cannot be read as JSON: its HTTP status, why, and the field at fault if one is."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def json_body(request: web.Request) -> Any:
    """The request's JSON body, or BodyError (400, 413 or 415)."""
    charset = request.charset
    if charset is not None and charset.lower() not in UTF8:
        raise BodyError(415, f"unsupported charset {charset[:40]!r}: JSON bodies must be UTF-8")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyError(413, f"request body is larger than {request.client_max_size} bytes") from None
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise BodyError(400, f"request body is not UTF-8: {err.reason} at byte {err.start}") from None
    except RecursionError:
        raise BodyError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, and integers too long to convert
        raise BodyError(400, f"request body is not valid JSON: {str(err)[:200]}") from None
    if depth(value) > MAX_JSON_DEPTH:
        raise BodyError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    if (path := lone_surrogate_path(value)) is not None:
        raise BodyError(400, f"{path or 'request body'}: {LONE_SURROGATE}", path or None)
    return value


def depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (iterative: no recursion to overflow)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest
