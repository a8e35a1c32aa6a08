"""On a cluster head, the inference routes go to one of the Model's replicas.

The middleware reads the request's ``model``, asks the router for a replica
(``control/routing.py``), and either lets this daemon's own route serve it or
relays it to the worker that runs the replica: the request as sent, the
response as the worker writes it (status, headers that matter, and the body
chunk by chunk, so a stream stays a stream and usage, ``cached_tokens`` and
the speculation report come back unchanged). A client that leaves closes the
upstream request, which cancels it on the worker; a worker lost mid-stream
(its connection reset, or its Node NotReady) ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from ..control.cluster import HEARTBEAT_SECONDS, Member
from .completion import stream_error
from .errors import APIError, unavailable
from .keys import MODELS

ROUTED = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings")
RELAYED_HEADERS = ("Content-Type", "Cache-Control", "Retry-After", "X-Request-Id")


@web.middleware
async def route_to_replica(request: web.Request, handler) -> web.StreamResponse:
    models = request.app[MODELS]
    if models.cluster is None or request.method != "POST" or request.path not in ROUTED:
        return await handler(request)
    raw = await request.read()
    try:
        body = json.loads(raw)
        name = body["model"]
        served = models.registry.models[name]
    except (ValueError, TypeError, KeyError):
        return await handler(request)  # the route says what is wrong with it
    if not served.replica_nodes:
        return await handler(request)
    replicas = models.ready_replicas(name) or models.idle_replicas(name)
    if not replicas:
        if models.node.name in served.replica_nodes:
            return await handler(request)  # this node's replica loads: the route waits for it
        raise unavailable(f"model {name!r} has no ready replica ({served.reason})", 5)
    replica = models.router.pick(name, replicas, body)
    models.metrics.routed_requests.labels(name, replica.node).inc()
    models.router.started(name, replica.node)
    try:
        if replica.address is None:
            return await handler(request)
        return await relay(request, replica.address, raw, models.cluster.members[replica.node])
    finally:
        models.router.finished(name, replica.node)


async def relay(request: web.Request, address: str, raw: bytes, member: Member) -> web.StreamResponse:
    """Relay the request to a worker; a Node that dies, or goes NotReady (a Mac that hangs or
    is cut off keeps its connections open), fails it."""
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "anthropic-version", "accept")}
    response: web.StreamResponse | None = None

    async def copy() -> None:
        nonlocal response
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
            async with session.post(address + request.path_qs, data=raw, headers=headers) as upstream:
                response = web.StreamResponse(status=upstream.status, headers={
                    k: upstream.headers[k] for k in RELAYED_HEADERS if k in upstream.headers})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()

    relaying = asyncio.ensure_future(copy())
    try:
        while not (await asyncio.wait({relaying}, timeout=HEARTBEAT_SECONDS))[0]:
            if not member.ready:
                relaying.cancel()
                raise ConnectionResetError(f"Node {member.name} is NotReady ({member.reason})")
        await relaying
        return response
    except (aiohttp.ClientError, ConnectionResetError, OSError) as exc:
        err = APIError(502, f"the replica's Node failed: {type(exc).__name__}: {exc}", "server_error", None,
                       "replica_failed")
        if response is None or not response.prepared:
            raise err from None
        if "text/event-stream" in response.headers.get("Content-Type", ""):
            await response.write(stream_error(request, err))
        await response.write_eof()
        return response
    finally:
        relaying.cancel()  # the client left: closing the upstream request cancels it on the worker
