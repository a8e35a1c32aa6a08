"""The running daemon: the routes (``server``) and the control plane (``control``) side by side
in one aiohttp application. The routes see the control plane only through the serving registry,
the store and ``server.keys.ControlView``; this module is where the two meet."""

from __future__ import annotations

import asyncio

from aiohttp import web

from .control.agent import NodeAgent
from .control.plane import ControlPlane
from .control.watcher import ManifestDirectory
from .core.memory import return_freed_memory
from .server.app import MAX_BODY_BYTES, create_app
from .server.keys import STARTED
from .server.response_store import ResponseStore

HEAP_TRIM_SECONDS = 30.0


async def return_freed_memory_every(seconds: float) -> None:
    """Under steady load glibc's heap keeps what MLX and the engines free
    (fragments of it no later allocation fits), and the daemon's RSS creeps
    up; handing it back now and then keeps RSS at what is actually in use."""
    while True:
        await asyncio.sleep(seconds)
        await asyncio.to_thread(return_freed_memory)


def daemon_app(control: ControlPlane, manifests: ManifestDirectory | None = None, admin_token: str | None = None,
               drain_grace: float = 30.0, agent: NodeAgent | None = None, api_keys: tuple[bytes, ...] = (),
               cors_origins: tuple[str, ...] = (), max_body_bytes: int = MAX_BODY_BYTES,
               stored_responses: ResponseStore | None = None, drop_hosted_tools: bool = False,
               fetch_image_urls: bool = False) -> web.Application:
    """The daemon's application. The control plane starts after the server listens, so
    ``/healthz`` and ``/readyz`` answer while weights load; a worker's ``agent`` joins its head."""
    app = create_app(control.registry, control.store, control, control.cluster, admin_token, api_keys, cors_origins,
                     max_body_bytes, stored_responses, drop_hosted_tools, fetch_image_urls)

    async def control_plane(app: web.Application):
        stop = asyncio.Event()
        tasks = [asyncio.create_task(control.run()),
                 asyncio.create_task(return_freed_memory_every(HEAP_TRIM_SECONDS))]
        if manifests is not None:
            tasks.append(asyncio.create_task(manifests.watch(stop)))
        if agent is not None:
            tasks.append(asyncio.create_task(agent.run()))
        app[STARTED].set()
        yield
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await control.shutdown(drain_grace)

    app.cleanup_ctx.append(control_plane)
    return app
