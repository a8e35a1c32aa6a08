"""The aiohttp application: OpenAI routes, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..parallel.group import with_engine_metrics
from ..serving.cluster import Cluster
from ..serving.registry import ModelRegistry
from ..store import Store
from . import admin, anthropic, cluster_api, embeddings, openai, replica_api, responses
from .access import api_access, cors_headers
from .completion import WAITING_STREAM, stream_error
from .errors import APIError
from .keys import (ADMIN_TOKEN, API_KEYS, CLUSTER, CONTROL, CORS_ORIGINS, DROP_HOSTED_TOOLS, FETCH_IMAGE_URLS, REGISTRY,
                   RESPONSES, STARTED, STORE, ControlView)
from .response_store import ResponseStore

log = structlog.get_logger(__name__)
routes = web.RouteTableDef()
MAX_BODY_BYTES = 16 * 1024 * 1024  # --max-body-bytes; larger bodies get a 413
PROBES = ("/healthz", "/readyz", "/metrics")  # polled by orchestrators: a 503 while loading is not news for the log


@web.middleware
async def request_context(request: web.Request, handler) -> web.StreamResponse:
    """Give every request an id (logged, echoed back) and turn every failure
    into a JSON error (OpenAI's shape, Anthropic's under /v1/messages)
    instead of a stack trace."""
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.monotonic()
    response = None
    try:
        anthropic = request.path.startswith("/v1/messages")  # errors in the shape its clients expect
        try:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                raise APIError(exc.status, exc.reason, "invalid_request_error") from None
            except (APIError, asyncio.CancelledError):
                raise
            except Exception:
                log.exception("unhandled error", path=request.path)
                raise APIError(500, "internal server error", "server_error") from None
        except APIError as err:
            response = request.get(WAITING_STREAM)
            if response is not None:  # a stream opened while its Model loaded: the error is its last event
                await response.write(stream_error(request, err))
                await response.write_eof()
            else:
                response = err.anthropic_response() if anthropic else err.response()
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
        return response
    finally:
        record_request(request, response.status if response is not None else 499, time.monotonic() - started)
        structlog.contextvars.unbind_contextvars("request_id")


def record_request(request: web.Request, status: int, seconds: float) -> None:
    """Count the request in ``http_requests_total`` and log it: inference
    routes at info, every other client error at warning and server error at
    error (probes aside), so a client sending a field specd refuses, or a
    wrong URL, shows up."""
    route = request.match_info.route
    handler = route.resource.canonical if route.resource is not None else "none"  # an unmatched path
    metrics = request.app[REGISTRY].metrics
    metrics.http_requests.labels(request.method, handler, str(status)).inc()
    metrics.http_request_duration.labels(request.method, handler).observe(seconds)
    level = "error" if status >= 500 else "warning" if status >= 400 else "info"
    if request.path.startswith("/v1/") or (level != "info" and handler not in PROBES):
        getattr(log, level)("request", method=request.method, path=request.path, status=status,
                            seconds=round(seconds, 4))


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    store = request.app[STORE]
    problems = registry.not_ready()
    problems.update({o.name: "Pending" for o in store.list("Model") if o.name not in registry.models})
    if problems or not request.app[STARTED].is_set():
        return web.json_response({"status": "not ready", "models": problems}, status=503)
    return web.json_response({"status": "ready"})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    body = generate_latest(with_engine_metrics(registry.metrics.registry, registry.engines()))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(registry: ModelRegistry, store: Store, control: ControlView, cluster: Cluster | None = None,
               admin_token: str | None = None, api_keys: tuple[bytes, ...] = (),
               cors_origins: tuple[str, ...] = (), max_body_bytes: int = MAX_BODY_BYTES,
               stored_responses: ResponseStore | None = None, drop_hosted_tools: bool = False,
               fetch_image_urls: bool = False) -> web.Application:
    """The routes over the serving registry (requests), the store (desired state) and what the
    admin API asks of the control plane; ``daemon.py`` runs the control plane beside them.
    Stored Responses live in ``stored_responses`` (the daemon's is in its state directory;
    without one they last as long as the app). ``drop_hosted_tools`` leaves hosted tools
    (web search, ...) out of Responses requests instead of refusing them; ``fetch_image_urls``
    fetches the http(s) image URLs requests send instead of refusing them. A head (``cluster``)
    takes Nodes on its cluster API."""
    app = web.Application(middlewares=[request_context, api_access, admin.admin_guard],
                          client_max_size=max_body_bytes)
    app[REGISTRY] = registry
    app[STORE] = store
    app[CONTROL] = control
    if cluster is not None:
        app[CLUSTER] = cluster
    app[RESPONSES] = stored_responses if stored_responses is not None else ResponseStore()
    app[API_KEYS] = api_keys
    app[CORS_ORIGINS] = cors_origins
    app[DROP_HOSTED_TOOLS] = drop_hosted_tools
    app[FETCH_IMAGE_URLS] = fetch_image_urls
    app.on_response_prepare.append(cors_headers)
    if admin_token is not None:
        app[ADMIN_TOKEN] = admin_token
    app[STARTED] = asyncio.Event()  # set by whoever runs the control plane, once it runs
    app.add_routes(routes)
    app.add_routes(openai.routes)
    app.add_routes(anthropic.routes)
    app.add_routes(responses.routes)
    app.add_routes(embeddings.routes)
    app.add_routes(admin.routes)
    app.add_routes(cluster_api.routes)
    app.add_routes(replica_api.routes)

    async def close_responses(app: web.Application) -> None:
        app[RESPONSES].close()
    app.on_cleanup.append(close_responses)
    return app
