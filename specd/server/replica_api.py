"""What a cluster head asks of a worker's engine: run one tokenized request, stream its outputs.

These are subresources of the admin API's Models (as ``pods/exec`` is Kubernetes'), so the
admin guard admits only the cluster token on a worker, and loopback clients on a daemon
without an admin token:
- ``models/{name}/engine``: what the head checks requests against (``engine_report``), once
  the Model is loaded (a replica at zero loads);
- ``models/{name}/generate``: the body is a ``GenerationRequest``, the answer one JSON
  ``StepOutput`` per line; a head that closes the connection cancels the request;
- ``models/{name}/embed``: token rows in, their vectors out.
``serving/remote.py`` is the other end.
"""

from __future__ import annotations

import json
from dataclasses import replace

from aiohttp import web

from ..api.paths import MODEL_EMBED, MODEL_ENGINE, MODEL_GENERATE
from ..serving.registry import ModelNotFound, ModelNotReady, WrongTask
from ..core.request import merge_outputs
from ..engine.embedder import Embedder, EmbeddingFailed
from ..engine.engine import EngineOverloaded, EngineUnavailable
from ..engine.interface import ServingEngine
from ..serving.fence import EPOCH_HEADER, applied_epoch, sent_epoch
from ..serving.remote import engine_report, output_to_json, request_from_json
from ..engine.scheduler import RequestRejected
from .bodies import BodyError, json_body
from .errors import StatusError, status_error
from .keys import PLACEMENT_FENCE, REGISTRY, STORE

routes = web.RouteTableDef()


async def _engine(request: web.Request, task: str | None = None) -> ServingEngine | Embedder:
    """The Model's engine for ``task`` (None: its own) on this daemon, once loaded (a replica
    at zero starts loading), unless a worker's fence refuses the call (409)."""
    name = request.match_info["name"]
    registry = request.app[REGISTRY]
    fence = request.app.get(PLACEMENT_FENCE)
    if fence is not None and (stored := request.app[STORE].find("Model", name)) is not None:  # a worker's
        why = fence.refusal(name, applied_epoch(stored.annotations), sent_epoch(request.headers.get(EPOCH_HEADER)))
        if why is not None:
            raise StatusError(409, "StalePlacement", why)
    served = registry.models.get(name)
    task = task or (served.task if served is not None else "generate")
    try:
        return await (registry.embedder(name) if task == "embed" else registry.engine(name))
    except ModelNotFound as err:
        raise status_error(err, f'models "{name}" not found') from None
    except (ModelNotReady, WrongTask) as err:
        raise status_error(err) from None


@routes.get(MODEL_ENGINE.format("{name}"))
async def engine(request: web.Request) -> web.Response:
    return web.json_response(engine_report(await _engine(request)))


@routes.post(MODEL_GENERATE.format("{name}"))
async def generate(request: web.Request) -> web.StreamResponse:
    try:
        asked = request_from_json(await json_body(request))
    except BodyError as err:
        raise status_error(err) from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise StatusError(400, "BadRequest", f"not a generation request: {type(err).__name__}: {err}") from None
    engine = await _engine(request, "generate")
    try:  # this worker's edge: checked once against its own engine, which then trusts it
        engine.check_prompt(asked)
    except RequestRejected as err:
        raise status_error(err) from None
    asked = replace(asked, checked=True)
    outputs = engine.generate(asked)
    try:
        out = await anext(outputs)
    except (EngineOverloaded, EngineUnavailable) as err:
        raise status_error(err) from None
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        held = []  # a request the client reads whole is sent in one piece, not one line a step
        while True:
            held.append(out)
            finished = out.finish_reason is not None or out.error is not None
            if asked.stream or finished:
                await response.write(json.dumps(output_to_json(merge_outputs(held))).encode() + b"\n")
                held = []
            if finished:
                break
            out = await anext(outputs)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the head left: closing the outputs cancels the request
    finally:
        await outputs.aclose()
    return response


@routes.post(MODEL_EMBED.format("{name}"))
async def embed(request: web.Request) -> web.Response:
    try:
        body = await json_body(request)
        rows = [[int(t) for t in row] for row in body["rows"]]
    except BodyError as err:
        raise status_error(err) from None
    except (KeyError, TypeError, ValueError) as err:
        raise StatusError(400, "BadRequest", f"not an embedding request: {type(err).__name__}: {err}") from None
    embedder = await _engine(request, "embed")
    try:
        vectors = await embedder.embed(rows)
    except (RequestRejected, EngineOverloaded, EngineUnavailable, EmbeddingFailed) as err:
        raise status_error(err) from None
    return web.json_response({"vectors": vectors.tolist()})
