"""OpenAI's embeddings route, ``POST /v1/embeddings``, for Models whose
``spec.task`` is ``embed``.

``input`` is a string, a list of strings, a list of token ids or a list of
such lists (what the OpenAI SDKs send). ``dimensions`` keeps the first
dimensions of each vector (Matryoshka-trained checkpoints such as
Qwen3-Embedding are meant to be cut this way), normalized again when the
checkpoint normalizes. ``encoding_format: base64`` sends each vector as
little-endian float32 bytes, as the SDKs decode it.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from aiohttp import web

from ..engine.embedder import Embedder, EmbeddingFailed
from ..engine.engine import EngineOverloaded, EngineUnavailable
from ..engine.scheduler import RequestRejected
from .completion import embedder_named, integer_field, model_request, off_loop, read_json
from .errors import api_error, bad_request

routes = web.RouteTableDef()
FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows
ENCODINGS = ("float", "base64")


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _inputs(value: Any) -> list[str | list[int]]:
    """The request's inputs, each a string or a list of token ids."""
    inputs = [value] if isinstance(value, str) or _is_tokens(value) else _listed(value)
    for i, item in enumerate(inputs):
        if item == "":
            raise bad_request(f"input[{i}] is an empty string", f"input[{i}]")
    return inputs


def _listed(value: Any) -> list[str | list[int]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string, a list of strings, a list of token ids or a list of "
                          "such lists, and not empty", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"'input' may hold at most {MAX_INPUTS} inputs, got {len(value)}", "input")
    for i, item in enumerate(value):
        if not (isinstance(item, str) or _is_tokens(item)):
            raise bad_request(f"input[{i}] must be a string or a non-empty list of token ids", f"input[{i}]")
    return value


def _tokenized(embedder: Embedder, inputs: list[str | list[int]]) -> list[list[int]]:
    return [embedder.tokenizer.encode(item) if isinstance(item, str) else item for item in inputs]


def _checked(body: Any) -> dict:
    model_request(body, FIELDS)
    if body.get("encoding_format", "float") not in ENCODINGS:
        raise bad_request("'encoding_format' must be float or base64", "encoding_format")
    if not isinstance(body.get("user", ""), str):
        raise bad_request("'user' must be a string", "user")
    return body


def _shaped(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    if dimensions is None:
        return vectors
    cut = vectors[:, :dimensions]
    if normalize:
        cut = cut / np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), 1e-12)
    return cut.astype(np.float32)


@routes.post("/v1/embeddings")
async def create(request: web.Request) -> web.Response:
    body = _checked(await read_json(request))
    inputs = _inputs(body.get("input"))
    embedder = await embedder_named(request, body["model"])
    dimensions = integer_field(body, "dimensions", 1, embedder.dimensions)
    rows = await off_loop(lambda: _tokenized(embedder, inputs))
    try:
        vectors = await embedder.embed(rows)
    except (RequestRejected, EngineOverloaded, EngineUnavailable, EmbeddingFailed) as err:
        raise api_error(err) from None
    vectors = _shaped(vectors, dimensions, embedder.pooling.normalize)
    if body.get("encoding_format", "float") == "base64":
        encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        encoded = [v.tolist() for v in vectors]
    tokens = sum(len(r) for r in rows)
    return web.json_response({
        "object": "list", "model": embedder.name,
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
