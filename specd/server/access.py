"""Who may call the inference routes: optional API keys, and CORS for browsers.

Keys come from ``--api-key-file`` (one per line, or a Kubernetes-style Secret
whose ``stringData``/``data`` values are the keys).  A client sends one as
OpenAI's clients do (``Authorization: Bearer KEY``) or as Anthropic's do
(``x-api-key: KEY``); every configured key is compared in constant time.
Keys are never logged or echoed.
"""

from __future__ import annotations

import base64
import hmac
from pathlib import Path

import yaml
from aiohttp import web

from .errors import APIError
from .keys import API_KEYS, CORS_ORIGINS

INFERENCE_PREFIX = "/v1/"
CORS_HEADERS = "Authorization, Content-Type, X-Request-Id, x-api-key, anthropic-version, anthropic-beta"


def load_api_keys(path: Path) -> tuple[bytes, ...]:
    """The keys in ``path``: a Secret-like YAML object, else one key per line (``#`` comments)."""
    text = path.read_text(encoding="utf-8")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Secret":
        keys = [str(v) for v in (doc.get("stringData") or {}).values()]
        keys += [base64.b64decode(str(v)).decode("utf-8") for v in (doc.get("data") or {}).values()]
    else:
        keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    keys = [k.strip() for k in keys if k.strip()]
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return tuple(k.encode("utf-8") for k in keys)


def presented_key(request: web.Request) -> bytes | None:
    """The key the client sent, as bytes (a header that is not clean text matches no key)."""
    sent = request.headers.get("Authorization", "")
    value = sent[7:] if sent[:7].lower() == "bearer " else request.headers.get("x-api-key")
    if not value:
        return None
    try:
        return value.strip().encode("utf-8")
    except UnicodeEncodeError:  # undecodable header bytes arrive as surrogates
        return None


def key_matches(sent: bytes | None, keys: tuple[bytes, ...]) -> bool:
    matched = False
    for key in keys:  # every key compared, so the time does not say which one nearly matched
        matched |= hmac.compare_digest(key, sent or b"")
    return matched and sent is not None


def _allowed_origin(request: web.Request) -> str | None:
    """The request's Origin if CORS is configured for it on an inference route, else None."""
    origins: tuple[str, ...] = request.app.get(CORS_ORIGINS, ())
    origin = request.headers.get("Origin")
    if origin is None or not request.path.startswith(INFERENCE_PREFIX):
        return None
    return origin if "*" in origins or origin in origins else None


@web.middleware
async def api_access(request: web.Request, handler) -> web.StreamResponse:
    """CORS preflights for configured origins, then the API key on ``/v1/``."""
    if not request.path.startswith(INFERENCE_PREFIX):
        return await handler(request)
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers \
            and _allowed_origin(request) is not None:
        return web.Response(status=204, headers={"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                                                 "Access-Control-Allow-Headers": CORS_HEADERS,
                                                 "Access-Control-Max-Age": "600"})
    error = refused_key(request)
    if error is not None:
        return error.anthropic_response() if request.path.startswith("/v1/messages") else error.response()
    return await handler(request)


def refused_key(request: web.Request) -> APIError | None:
    """The 401 for a request without a configured API key (None: it may go on). The inference
    routes and the console's views ask for the same keys."""
    keys = request.app.get(API_KEYS)
    if keys and not key_matches(presented_key(request), keys):
        return APIError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key)",
                        "invalid_request_error", None, "invalid_api_key")
    return None


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: streamed responses send their headers from the handler, so CORS goes here."""
    origin = _allowed_origin(request)
    if origin is not None:
        wildcard = "*" in request.app.get(CORS_ORIGINS, ())
        response.headers["Access-Control-Allow-Origin"] = "*" if wildcard else origin
        response.headers["Vary"] = "Origin"
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
