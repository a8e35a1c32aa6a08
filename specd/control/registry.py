"""What is actually running: one entry per Model, with its engine and what it was built from.

The Model reconciler changes entries; the HTTP layer only reads them (``engine``,
``not_ready``).  Swapping an entry's engine is one assignment, so a request
either gets the old engine or the new one, never neither.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import structlog

from ..api.manifest import DraftPairingSpec, ModelSpec, SpecPolicySpec
from .download import DownloadProgress
from .replica_set import ReplicaSet
from .resources import MemoryRequest
from ..engine.embedder import Embedder
from ..engine.interface import ServingEngine
from ..metrics import Metrics
from ..core.request import Method, SpeculationConfig
from ..speculation.config import PolicySettings

log = structlog.get_logger(__name__)


class Phase(str, Enum):
    PENDING = "Pending"  # not placed yet: its request is being read, or it does not fit (Unschedulable)
    DOWNLOADING = "Downloading"  # its hub checkpoint is being fetched, before its request can be read
    IDLE = "Idle"  # minReplicas 0 and unloaded: the next request loads it
    LOADING = "Loading"
    READY = "Ready"
    FAILED = "Failed"


@dataclass(frozen=True)
class Pairing:
    """A DraftPairing as applied to a model (name and generation identify it)."""

    name: str
    generation: int
    spec: DraftPairingSpec

    @property
    def method(self) -> Method:
        return Method(self.spec.method)

    def speculation(self) -> SpeculationConfig:
        s = self.spec
        return SpeculationConfig(self.method, s.num_speculative_tokens, s.ngram_min, s.ngram_max,
                                 s.tree_top_k, s.tree_tokens)


@dataclass(frozen=True)
class Policy:
    name: str
    generation: int
    spec: SpecPolicySpec

    def settings(self) -> PolicySettings:
        """What the engine's controller takes (the spec less its selector)."""
        s = self.spec
        return PolicySettings(s.enabled, s.mode, s.max_speculative_tokens, s.disable_by_batch_size,
                              s.acceptance_rate_threshold, s.ema_alpha, s.probe_interval)


@dataclass
class ServedModel:
    name: str
    generation: int  # the Model generation of ``spec``
    spec: ModelSpec
    phase: Phase = Phase.PENDING
    reason: str = ""
    engine: ServingEngine | Embedder | None = None  # an Embedder when spec.task is embed
    load_seconds: float | None = None
    weight_bytes: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    pairing: Pairing | None = None  # applied to the engine
    pairing_error: str = ""
    policy: Policy | None = None  # applied to the engine
    task: asyncio.Task | None = None  # a load (or reload) in flight
    loading_generation: int | None = None
    # a group: what it was started for (topology name and generation, pairing),
    # its restarts, and when the next restart is due
    group_key: tuple | None = None
    restarts: int = 0
    last_failure: str = ""
    faults_seen: int = 0  # engine faults already reported as events
    retry_at: float | None = None
    # memory: the request of the serving engine, of the one loading, and of the spec (once read)
    request: MemoryRequest | None = None
    loading_request: MemoryRequest | None = None
    spec_request: tuple[tuple, MemoryRequest] | None = None  # (what it was computed for, the request)
    download: DownloadProgress | None = None  # its checkpoints' download, while reading its request
    unschedulable: str = ""  # why the spec cannot be placed now
    last_used: float = field(default_factory=time.monotonic)
    demand: int = 0  # requests waiting for it to load
    failures: int = 0  # loads in a row that failed for a reason that can pass (retried with backoff)
    restart: bool = False  # rollout restart asked for a fresh load
    replica_nodes: list[str] = field(default_factory=list)  # on a head: the Nodes its replicas are placed on
    group_memory: dict[str, int] = field(default_factory=dict)  # a group's bytes on each Node its ranks run on
    group_hosts: list[str] = field(default_factory=list)  # the hosts of its group's ranks, rank 0 first
    group_reserved: dict[str, int] = field(default_factory=dict)  # on a head: what it reserved for them on Nodes
    # on a head: its further replicas' groups, by the worker Node that runs rank 0 (their hosts, rank 0
    # first), and what their other ranks hold on Nodes
    remote_groups: dict[str, list[str]] = field(default_factory=dict)
    remote_group_memory: dict[str, int] = field(default_factory=dict)
    replicas_short: str = ""  # why some replicas fit no Node
    elsewhere: bool = False  # on a head: every replica runs on other Nodes
    replica_set: ReplicaSet | None = None  # on a head: what its requests go through, to one of its replicas
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake whoever waits for this Model to change (a request waiting for its load)."""
        self.changed.set()
        self.changed = asyncio.Event()


class ModelNotFound(KeyError):
    pass


class ModelNotReady(Exception):
    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _cannot_load_now(served: ServedModel) -> bool:
    """Whether a waiting request should hear why now rather than wait: the Model
    failed, waits out a backoff, or does not fit the node."""
    return served.phase is Phase.FAILED or bool(served.unschedulable) and served.loading_request is None


def _retry_after(served: ServedModel) -> int | None:
    if served.retry_at is not None:
        return max(1, round(served.retry_at - time.monotonic()))
    return 30 if served.unschedulable else None


class WrongTask(Exception):
    """The model serves another task (spec.task) than the route asks of it."""


DEFAULT_LOAD_TIMEOUT = 300.0  # seconds a request waits for its Model to load


class ModelRegistry:
    def __init__(self, metrics: Metrics, load_timeout: float = DEFAULT_LOAD_TIMEOUT):
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self.load_timeout = load_timeout
        self.on_demand: Callable[[str], None] = lambda name: None  # the Model reconciler looks at it

    async def engine(self, name: str) -> ServingEngine:
        """The engine generating for ``name``, once it is loaded (a Model at zero starts
        loading); raises ModelNotFound, ModelNotReady or WrongTask."""
        return await self._serving(name, "generate")

    async def embedder(self, name: str) -> Embedder:
        """The embedder serving ``name``, once it is loaded; raises ModelNotFound, ModelNotReady or WrongTask."""
        return await self._serving(name, "embed")

    async def _serving(self, name: str, task: str):
        served = self.models.get(name)
        if served is None:
            raise ModelNotFound(name)
        if served.spec.task != task:
            raise WrongTask(f"model {name!r} serves spec.task {served.spec.task}, not {task}")
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
                try:  # the Model reconciler places it, evicting idle Models if it must
                    await asyncio.wait_for(served.changed.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise ModelNotReady(f"model {name!r} is still {served.phase.value} after "
                                        f"{self.load_timeout:.0f}s", 10) from None
                if self.models.get(name) is not served:
                    raise ModelNotFound(name)
                if served.engine is None and _cannot_load_now(served):
                    state = "Unschedulable" if served.unschedulable else served.phase.value
                    raise ModelNotReady(f"model {name!r} is {state}: {served.reason}", _retry_after(served))
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
        for served in self.models.values():
            if served.task is not None:
                served.task.cancel()
        await asyncio.gather(*(e.shutdown(grace) for e in self.engines()),
                             *(m.replica_set.shutdown(grace) for m in self.models.values() if m.replica_set))
