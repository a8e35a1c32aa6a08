"""The running daemon: the routes (``server``) and the control plane (``control``) side by side
in one aiohttp application. The routes see the control plane only through the serving registry,
the store and ``server.keys.ControlView``; this module is where the two meet."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from aiohttp import web

from .console.routes import add_console
from .control.agent import NodeAgent
from .control.plane import ControlPlane
from .control.watcher import ManifestDirectory
from .core.memory import freeze_startup_objects, return_freed_memory
from .server.app import MAX_BODY_BYTES, create_app
from .server.keys import ADMIN_OVER_TLS_ONLY, PLACEMENT_FENCE, STARTED
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
    add_console(app)
    if agent is not None:
        app[ADMIN_OVER_TLS_ONLY] = True
        app[PLACEMENT_FENCE] = agent.fence

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


def run_daemon(app: web.Application, listeners: list[tuple[str, int, ssl.SSLContext | None]],
               shutdown_timeout: float) -> None:
    """``web.run_app``, with a listener of its own for each (host, port, TLS context): a head's or
    worker's cluster port speaks TLS beside the plain API port (``run_app`` gives every listener
    the same context). Until SIGTERM or SIGINT has drained it."""
    async def serve() -> None:
        runner = web.AppRunner(app, handle_signals=True, handler_cancellation=True, access_log=None,
                               shutdown_timeout=shutdown_timeout)
        await runner.setup()
        try:
            for host, port, context in listeners:
                await web.TCPSite(runner, host, port, ssl_context=context).start()
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    freeze_startup_objects()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
