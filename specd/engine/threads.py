"""The threads engines step on: long-lived, and reused by the next engine.

MLX's streams belong to the thread that made them, and MLX keeps a thread of
its own for each stream until the process ends (a CPU engine deals a layer's
rows to several streams, ``core/kv.py``). An engine on a thread of its own
would leave those behind each time its Model unloads (scale to zero, a
reload, a fault's restart), so a daemon that runs for weeks would grow
threads without bound. Instead an engine runs on a thread that outlives it:
when it stops, the thread, and the streams made on it, serve the next engine.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import structlog

log = structlog.get_logger(__name__)
IDLE_NAME = "engine-idle"


class _Worker(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name=IDLE_NAME, daemon=True)
        self.jobs: queue.SimpleQueue[tuple[Callable[[], None], str, threading.Event]] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            target, name, done = self.jobs.get()
            self.name = name
            try:
                target()
            except Exception:  # the engine's own loop catches its faults; this is a bug in it
                log.exception("an engine thread's loop raised", thread=name)
            self.name = IDLE_NAME
            del target  # an idle thread must not keep its last engine (its model's weights) alive
            with _lock:
                _idle.append(self)
            done.set()


_lock = threading.Lock()
_idle: list[_Worker] = []


def run(target: Callable[[], None], name: str) -> threading.Event:
    """Run ``target`` on an idle engine thread (a new one if none is idle), named ``name`` while it
    runs; the event is set once it has returned and its thread is free again."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
        worker.start()
    done = threading.Event()
    worker.jobs.put((target, name, done))
    return done
