"""The web console at ``/ui``: static files from the package, and two read-only views of the
daemon (on a head, of the whole cluster) that the console polls.

The views ask for the API key the inference routes ask for; changes go through the admin API,
with its access rules, so the console can do nothing the admin API would refuse. Every
response carries the headers a browser app should have: a Content-Security-Policy that
allows this daemon only (no CDN, no inline script), no framing, no sniffing, no referrer.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from ..api.paths import API_VERSION
from ..parallel.group import with_engine_metrics
from ..server.access import refused_key
from ..server.keys import CLUSTER, CONTROL, REGISTRY, STORE
from .figures import FigureHistory, Totals, scraped, totals

log = structlog.get_logger(__name__)
routes = web.RouteTableDef()
FIGURES = web.AppKey("console_figures", FigureHistory)
STATIC = resources.files(__package__) / "static"
FILES = {  # what /ui/ serves: these files only, from the package
    "index.html": "text/html", "app.mjs": "text/javascript", "style.css": "text/css",
    "vendor/htm-preact-standalone.mjs": "text/javascript", "favicon.svg": "image/svg+xml",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
RECENT_EVENTS = 10
WORKER_SCRAPE_SECONDS = 2.0


def _json(body: Any) -> web.Response:
    return web.json_response(body, headers={**HEADERS, "Cache-Control": "no-store"})


def _models(request: web.Request) -> list[dict[str, Any]]:
    """Every Model as stored (spec and status) with its recent events, and the pairings and
    policies that name it."""
    store = request.app[STORE]
    pairings = [o.manifest(API_VERSION) for o in store.list("DraftPairing")]
    policies = [o.manifest(API_VERSION) for o in store.list("SpecPolicy")]
    out = []
    for obj in store.list("Model"):
        name = obj.name
        out.append({"object": obj.manifest(API_VERSION),
                    "events": store.events("Model", name)[-RECENT_EVENTS:],
                    "pairings": [p for p in pairings if p["spec"].get("targetRef") == name],
                    "policies": [p for p in policies if p["spec"].get("targetRef") == name]})
    return out


@routes.get("/ui/api/overview")
async def overview(request: web.Request) -> web.Response:
    """What the Nodes and Models views draw: every Node (memory, readiness, last heartbeat) and
    every Model with its status, events, drafter and policy."""
    if (refusal := refused_key(request)) is not None:
        return refusal.response()
    control = request.app[CONTROL]
    nodes = control.nodes()
    role = nodes[0]["spec"]["role"] if nodes else "standalone"
    models = await asyncio.to_thread(_models, request)  # store reads: off the loop
    return _json({"node": control.node_name, "role": role, "nodes": nodes, "models": models})


@routes.get("/ui/api/figures")
async def figures(request: web.Request) -> web.Response:
    """Each Model's live figures over the last minutes, from ``/metrics``' counters."""
    if (refusal := refused_key(request)) is not None:
        return refusal.response()
    return _json(await request.app[FIGURES].series())


@routes.get("/ui")
async def console_root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/", headers=HEADERS)


@routes.get("/ui/{path:.*}")  # after the views: routes match in order
async def console_file(request: web.Request) -> web.Response:
    path = request.match_info["path"] or "index.html"
    if path not in FILES:
        raise web.HTTPNotFound(headers=HEADERS)
    return web.Response(body=(STATIC / path).read_bytes(), content_type=FILES[path],
                        headers={**HEADERS, "Cache-Control": "no-cache"})


async def _read_totals(app: web.Application) -> Totals:
    """This daemon's counters and, on a head, each Ready worker's ``/metrics`` (over the cluster's
    TLS), summed per Model. A worker that does not answer in time is left out of this sample."""
    registry = app[REGISTRY]
    samples = [s for f in with_engine_metrics(registry.metrics.registry, registry.engines()).collect()
               for s in f.samples]
    cluster = app.get(CLUSTER)
    if cluster is not None and cluster.ready():
        async def worker_samples(session: aiohttp.ClientSession, address: str) -> list:
            try:
                async with session.get(address.rstrip("/") + "/metrics") as r:
                    return scraped(await r.text()) if r.status == 200 else []
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
                log.debug("worker metrics not read", address=address, error=str(err))
                return []
        timeout = aiohttp.ClientTimeout(total=WORKER_SCRAPE_SECONDS)
        async with cluster.session(timeout=timeout) as session:
            for more in await asyncio.gather(*(worker_samples(session, m.address) for m in cluster.ready())):
                samples += more
    return totals(samples)


def add_console(app: web.Application) -> None:
    """Serve the console from ``app``: its files, its views, and the sampler behind its charts."""
    history = FigureHistory(lambda: _read_totals(app))
    app[FIGURES] = history
    app.add_routes(routes)

    async def stop_sampling(app: web.Application) -> None:
        await history.close()
    app.on_cleanup.append(stop_sampling)
