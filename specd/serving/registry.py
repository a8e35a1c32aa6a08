"""What serves each Model, as the request path sees it: its engine or replicas, and why not.

The control plane writes an entry's fields (``control/``: the Model reconciler); the
routes only read them, through ``engine``/``embedder`` and ``not_ready``.  Swapping an
entry's engine is one assignment, so a request either gets the old engine or the new
one, never neither.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from ..engine.embedder import Embedder
from ..engine.interface import ServingEngine
from ..metrics import Metrics
from .replica_set import ReplicaSet


class Phase(str, Enum):
    PENDING = "Pending"  # not placed yet: its request is being read, or it does not fit (Unschedulable)
    DOWNLOADING = "Downloading"  # its hub checkpoint is being fetched, before its request can be read
    IDLE = "Idle"  # minReplicas 0 and unloaded: the next request loads it
    LOADING = "Loading"
    READY = "Ready"
    FAILED = "Failed"


@dataclass
class ServedModel:
    """A Model as its requests find it: what serves it now, or why nothing does."""

    name: str
    task: str = "generate"  # spec.task: generate or embed
    phase: Phase = Phase.PENDING
    reason: str = ""
    engine: ServingEngine | Embedder | None = None  # an Embedder when task is embed
    replica_set: ReplicaSet | None = None  # on a head: what its requests go through, to one of its replicas
    elsewhere: bool = False  # on a head: every replica runs on other Nodes
    unschedulable: str = ""  # why its spec cannot be placed now
    loading: bool = False  # a load holds memory for it now
    retry_at: float | None = None  # when a failed load is tried again (monotonic seconds)
    created: int = field(default_factory=lambda: int(time.time()))
    last_used: float = field(default_factory=time.monotonic)
    demand: int = 0  # requests waiting for it to load
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake whoever waits for this Model to change (a request waiting for its load)."""
        self.changed.set()
        self.changed = asyncio.Event()

    def cannot_load_now(self) -> bool:
        """Whether a waiting request should hear why now rather than wait: the Model
        failed, waits out a backoff, or does not fit the node."""
        return self.phase is Phase.FAILED or bool(self.unschedulable) and not self.loading

    def retry_after(self) -> int | None:
        if self.retry_at is not None:
            return max(1, round(self.retry_at - time.monotonic()))
        return 30 if self.unschedulable else None


class ModelNotFound(KeyError):
    pass


class ModelNotReady(Exception):
    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class WrongTask(Exception):
    """The model serves another task (spec.task) than the route asks of it."""


DEFAULT_LOAD_TIMEOUT = 300.0  # seconds a request waits for its Model to load


class ModelRegistry:
    def __init__(self, metrics: Metrics, load_timeout: float = DEFAULT_LOAD_TIMEOUT):
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self.load_timeout = load_timeout
        self.on_demand: Callable[[str], None] = lambda name: None  # the control plane looks at the Model

    def entry(self, name: str, task: str) -> ServedModel:
        """The Model ``name`` if it serves ``task`` (nothing waits); raises ModelNotFound or WrongTask."""
        served = self.models.get(name)
        if served is None:
            raise ModelNotFound(name)
        if served.task != task:
            raise WrongTask(f"model {name!r} serves spec.task {served.task}, not {task}")
        return served

    async def engine(self, name: str) -> ServingEngine:
        """The engine generating for ``name``, once it is loaded (a Model at zero starts
        loading); raises ModelNotFound, ModelNotReady or WrongTask."""
        return await self._serving(name, "generate")

    async def embedder(self, name: str) -> Embedder:
        """The embedder serving ``name``, once it is loaded; raises ModelNotFound, ModelNotReady or WrongTask."""
        return await self._serving(name, "embed")

    async def _serving(self, name: str, task: str):
        served = self.entry(name, task)
        served.last_used = time.monotonic()
        replicas = served.replica_set
        if replicas is not None and await replicas.wake():
            return replicas
        if replicas is not None and served.elsewhere:
            raise ModelNotReady(f"model {name!r} has no ready replica ({served.reason})", 5)
        if served.engine is not None:
            return replicas or served.engine
        served.demand += 1
        self.on_demand(name)
        deadline = time.monotonic() + self.load_timeout
        try:
            while served.engine is None:
                if served.phase is Phase.FAILED and served.retry_at is None:
                    raise ModelNotReady(f"model {name!r} is {served.phase.value}: {served.reason}")
                try:  # the control plane places it, evicting idle Models if it must
                    await asyncio.wait_for(served.changed.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise ModelNotReady(f"model {name!r} is still {served.phase.value} after "
                                        f"{self.load_timeout:.0f}s", 10) from None
                if self.models.get(name) is not served:
                    raise ModelNotFound(name)
                if served.engine is None and served.cannot_load_now():
                    state = "Unschedulable" if served.unschedulable else served.phase.value
                    raise ModelNotReady(f"model {name!r} is {state}: {served.reason}", served.retry_after())
        finally:
            served.demand -= 1
        served.last_used = time.monotonic()
        return replicas or served.engine

    def engines(self) -> list[ServingEngine | Embedder]:
        return [m.engine for m in self.models.values() if m.engine is not None]

    def not_ready(self) -> dict[str, str]:
        """Reasons, by model, why the daemon is not ready (empty when it is): a Model
        at zero replicas, or served by other Nodes, is as it should be."""
        return {n: (f"{m.phase.value}: {m.reason}" if m.reason else m.phase.value)
                for n, m in self.models.items() if m.engine is None and m.phase is not Phase.IDLE and not m.elsewhere}

    async def shutdown(self, grace: float) -> None:
        await asyncio.gather(*(e.shutdown(grace) for e in self.engines()),
                             *(m.replica_set.shutdown(grace) for m in self.models.values() if m.replica_set))
