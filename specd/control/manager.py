"""Runs one reconciler per kind, as controller-runtime's manager runs controllers.

Each reconciler looks at one object by name and returns a ``Result`` saying when to
look again (``requeue_after``). The manager keeps the work queue: the names that
changed in the store, those a watch maps a change of another kind to (a
DraftPairing's change to its target Model), those whose requeue came due, and,
every ``RESYNC_SECONDS`` by the clock, every name (a resync catches what no event
announced, or an event that was missed: memory freed by another Model's drain, a
clock); no rate of events delays it. A name is queued once however often it is asked
for, and one that fails is retried with backoff.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import structlog

from ..store import Store

log = structlog.get_logger(__name__)
RESYNC_SECONDS = 5.0

Key = tuple[str, str]  # (kind, name)
Mapper = Callable[[str], Iterable[str]]  # a changed object's name -> the names of another kind to look at


@dataclass(frozen=True)
class Result:
    requeue_after: float | None = None  # seconds until the object should be looked at again


class Reconciler(Protocol):
    kind: str

    def reconcile(self, name: str) -> Result:
        """Make what runs for the named object match what is desired, and write its status."""

    def names(self) -> Iterable[str]:
        """Every name a resync looks at: the stored objects and what still runs for deleted ones."""


def _failure_backoff(failures: int) -> float:
    """Seconds before looking again at an object whose reconcile raised ``failures`` times in a row."""
    return min(30.0, 0.5 * 2.0 ** (failures - 1))


class Manager:
    def __init__(self, store: Store):
        self.reconcilers: dict[str, Reconciler] = {}
        self._watches: dict[str, list[tuple[str, Mapper, bool]]] = {}
        self._queue: dict[Key, None] = {}  # insertion-ordered and without repeats
        self._ready = asyncio.Event()
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._failures: dict[Key, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.resyncs = 0  # how many resyncs ran
        store.watch(lambda kind, name: self._changed(kind, name, False))
        store.watch_status(lambda kind, name: self._changed(kind, name, True))

    def add(self, reconciler: Reconciler) -> None:
        self.reconcilers[reconciler.kind] = reconciler

    def watch(self, source: str, target: str, mapper: Mapper, status: bool = False) -> None:
        """A change to a ``source`` object queues ``mapper(name)`` of kind ``target``;
        with ``status``, so does a change of its status (a reconciler reporting on it)."""
        self._watches.setdefault(source, []).append((target, mapper, status))

    def enqueue(self, kind: str, name: str) -> None:
        """Look at the object soon (callable from any thread)."""
        if self._loop is None:
            self._add((kind, name))
        else:
            self._loop.call_soon_threadsafe(self._add, (kind, name))

    def enqueue_all(self, kind: str) -> None:
        for name in list(self.reconcilers[kind].names()):
            self.enqueue(kind, name)

    def resync(self) -> None:
        for kind in self.reconcilers:
            self.enqueue_all(kind)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        resyncing = asyncio.create_task(self._resync_every(RESYNC_SECONDS))
        try:
            await self._work()
        finally:
            resyncing.cancel()

    async def _resync_every(self, seconds: float) -> None:
        """Queue every name now and every ``seconds`` after, whatever else is queued meanwhile."""
        while True:
            self.resync()
            self.resyncs += 1
            await asyncio.sleep(seconds)

    async def _work(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                key = next(iter(self._queue))
                del self._queue[key]
                self._reconcile(key)
                await asyncio.sleep(0)  # requests and heartbeats go on between objects

    def _changed(self, kind: str, name: str, status: bool) -> None:
        """A store change (from any thread): its watches are mapped on the loop, where the
        reconcilers' state is only ever touched."""
        if self._loop is None:
            self._map_change(kind, name, status)
        else:
            self._loop.call_soon_threadsafe(self._map_change, kind, name, status)

    def _map_change(self, kind: str, name: str, status: bool) -> None:
        if not status:
            self._add((kind, name))
        for target, mapper, on_status in self._watches.get(kind, []):
            if on_status or not status:
                for mapped in list(mapper(name)):
                    self._add((target, mapped))

    def _add(self, key: Key) -> None:
        if key[0] in self.reconcilers:
            self._queue[key] = None
            self._ready.set()

    def _reconcile(self, key: Key) -> None:
        kind, name = key
        try:
            result = self.reconcilers[kind].reconcile(name)
        except Exception:
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            log.exception("reconcile failed", kind=kind, name=name, failures=failures)
            result = Result(_failure_backoff(failures))
        else:
            self._failures.pop(key, None)
        if result.requeue_after is not None:
            self._requeue(key, result.requeue_after)

    def _requeue(self, key: Key, delay: float) -> None:
        """Look again in ``delay`` seconds, unless an earlier look is set already."""
        due = self._loop.time() + max(0.0, delay)
        pending = self._timers.get(key)
        if pending is not None and not pending[1].cancelled() and pending[0] <= due:
            return
        if pending is not None:
            pending[1].cancel()
        self._timers[key] = (due, self._loop.call_at(due, self._due, key))

    def _due(self, key: Key) -> None:
        self._timers.pop(key, None)
        self._add(key)
