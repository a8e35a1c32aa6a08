"""A Model's replicas across the cluster, served as one engine: each request goes to one of them.

On a head, a Model placed on Nodes (``spec.replicas``) is served through a
``ReplicaSet``: the HTTP routes render, tokenize and check a request with it as
with any engine, and ``generate`` (or ``embed``, for an embedding Model) hands
the request to one replica the router picks (``routing.Router``: the one
holding its prefix, else the least busy). A replica is the head's own engine,
or a ``RemoteEngine``/``RemoteEmbedder`` for a worker Node whose heartbeat
reports the Model ready, with what the head checks requests against (context
window, vocabulary, drafter). A replica at zero on a worker (``minReplicas:
0``) is woken by asking the worker for its engine, which loads it.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager, suppress
from typing import Any, AsyncIterator, Callable, Iterator

import aiohttp
import numpy as np
import structlog

from ..core.request import GenerationRequest, Method, SpeculationConfig, StepOutput
from ..engine.embedder import Embedder, check_rows
from ..engine.engine import EngineUnavailable
from ..engine.interface import ServingEngine
from ..api.paths import MODEL_ENGINE
from .remote import RemoteEmbedder, RemoteEngine, ReplicaUnreachable
from ..engine.scheduler import check_request
from ..metrics import Metrics
from ..speculation.config import PolicySettings
from .cluster import HEARTBEAT_SECONDS, Cluster, Member
from .fence import EPOCH_HEADER
from .routing import Router

log = structlog.get_logger(__name__)
WOKEN_SECONDS = 3 * HEARTBEAT_SECONDS  # a woken replica counts as ready until its Node's heartbeats say

Replica = ServingEngine | Embedder | RemoteEngine | RemoteEmbedder


class Replicas:
    """A Model's replicas by Node: which are ready now (the head's own engine while it is loaded, a
    worker's as its heartbeats report it), waking one at zero, and the one a request goes to."""

    def __init__(self, name: str, task: str, here: str, cluster: Cluster, router: Router, metrics: Metrics,
                 local: Callable[[], ServingEngine | Embedder | None], tokenizer: Callable[[], Any]):
        self.name, self.task, self.here = name, task, here
        self.cluster, self.router, self.metrics = cluster, router, metrics
        self._local = local  # the head's own replica's engine, while it is loaded
        self._tokenizer = tokenizer  # what the head tokenizes the Model's requests with (None: not yet)
        self.nodes: list[str] = []  # where the Model's replicas are placed (the Model reconciler keeps it)
        self.epoch = 0  # the placement's epoch, sent with every call to a worker (``serving/fence.py``)
        self._remote: dict[str, tuple[tuple, RemoteEngine | RemoteEmbedder]] = {}  # node -> ((address, instance), it)
        self._woken: dict[str, float] = {}  # node -> when its replica at zero answered that it loaded
        self._incarnations: dict[str, tuple] = {}  # node -> the engine the router's RAM index describes
        self._last: Replica | None = None

    def ready_nodes(self) -> list[str]:
        """The Nodes whose replica is loaded and reachable now."""
        return [n for n in self.nodes if (self._local() is not None if n == self.here else self._reported(n))]

    def ready(self) -> dict[str, Replica]:
        """The replicas a request may go to now, by Node."""
        if self._tokenizer() is None:
            return {}
        out: dict[str, Replica] = {}
        for node in self.nodes:
            if node == self.here:
                if (local := self._local()) is not None:
                    out[node] = local
            elif reported := self._reported(node):
                out[node] = self._remote_engine(self.cluster.members[node], reported)
        return out

    def _reported(self, node: str) -> dict[str, Any] | None:
        """What a Ready worker last reported of its replica's engine, if it serves."""
        member = self.cluster.members.get(node)
        if member is None or not member.ready:
            return None
        reported = member.model(self.name) or {}
        if reported.get("ready") and "engine" in reported:
            return reported["engine"]
        woken = self._woken.get(node)
        if woken is not None and time.monotonic() - woken < WOKEN_SECONDS and node in self._remote:
            return self._remote[node][1].reported  # its heartbeat has not said so yet
        return None

    def phases(self) -> dict[str, str]:
        """Each replica's phase on another Node, as its Node last reported it: ``Unknown`` while the
        Node is NotReady or gone, ``Pending`` until its Node reports the Model."""
        out = {}
        for node in self.nodes:
            member = self.cluster.members.get(node)
            if node != self.here:
                out[node] = ("Unknown" if member is None or not member.ready
                             else (member.model(self.name) or {}).get("phase", "Pending"))
        return out

    def policies(self) -> dict[str, str | None]:
        """The SpecPolicy each ready replica on another Node reports it runs, by Node."""
        return {n: (self.cluster.members[n].model(self.name) or {}).get("specPolicy")
                for n in self.nodes if n != self.here and self._reported(n) is not None}

    def _remote_engine(self, member: Member, engine: dict[str, Any]) -> RemoteEngine | RemoteEmbedder:
        """The replica on ``member`` (a new one for a restarted daemon), updated with its report."""
        key = (member.address, member.instance)
        held = self._remote.get(member.name)
        if held is not None and held[0] == key:
            if held[1].reported is not engine:  # a newer heartbeat's report (``ready`` runs many times a request)
                held[1].update(engine)
            return held[1]
        if held is not None:
            asyncio.ensure_future(held[1].shutdown(0))  # its daemon is gone: so are its streams
        kind = RemoteEngine if self.task == "generate" else RemoteEmbedder
        lost = (lambda m=member: None if m.ready else f"NotReady ({m.reason})")
        remote = kind(self.name, member.name, member.address, self.cluster.session, self._tokenizer(), engine,
                      lost, lambda: self.epoch)
        self._remote[member.name] = (key, remote)
        return remote

    async def wake(self) -> bool:
        """Whether some replica is ready, after waking one at zero on a Ready worker if none was."""
        if self.ready():
            return True
        for node in self.nodes:
            member = self.cluster.members.get(node)
            if node == self.here or member is None or not member.ready or self._tokenizer() is None:
                continue
            try:
                async with self.cluster.session() as s:
                    async with s.get(member.address + MODEL_ENGINE.format(self.name),
                                     headers={EPOCH_HEADER: str(self.epoch)}) as r:
                        if r.status == 200:
                            self._remote_engine(member, await r.json())
                            self._woken[node] = time.monotonic()
                            return True
                        log.warning("a worker did not load its replica", node=node, status=r.status,
                                    reason=await r.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("worker unreachable", node=node, error=str(exc))
        return False

    def any(self) -> Replica:
        """A ready replica, else the last one seen ready (a request checked against it then finds
        none to go to, and fails as unavailable)."""
        ready = self.ready()
        if ready:
            self._last = next(iter(ready.values()))
        if self._last is None:
            raise EngineUnavailable(f"model {self.name!r} has no ready replica")
        return self._last

    def pick(self, tokens: list[int]) -> tuple[str, Replica]:
        """The ready replica a request of these tokens goes to (``Router``), counted by its Node."""
        ready = self.ready()
        if not ready:
            raise EngineUnavailable(f"model {self.name!r} has no ready replica")
        for node, replica in ready.items():
            self._restarted(node, replica)
        node = self.router.pick(self.name, sorted(ready), tokens)
        self.metrics.routed_requests.labels(self.name, node).inc()
        return node, ready[node]

    def _restarted(self, node: str, replica: Replica) -> None:
        """A replica whose engine is not the one the router last saw holds nothing in RAM."""
        if node == self.here:
            incarnation: tuple = (id(replica),)
        else:
            incarnation = (self.cluster.members[node].instance, self._remote[node][1].reported.get("incarnation"))
        if self._incarnations.get(node, incarnation) != incarnation:
            self.router.forget(self.name, node)
        self._incarnations[node] = incarnation

    @contextmanager
    def serving(self, node: str) -> Iterator[None]:
        """A request on the replica at ``node``: in flight (for the router and ``/metrics``) until it
        ends, and failed if it raises (a client going away is neither)."""
        self.router.started(self.name, node)
        running = self.metrics.replica_requests_running.labels(self.name, node)
        running.inc()
        try:
            yield
        except Exception:
            self.metrics.replica_failed_requests.labels(self.name, node).inc()
            raise
        finally:
            running.dec()
            self.router.finished(self.name, node)

    async def shutdown(self, grace: float) -> None:
        """Let requests to the remote replicas finish; the head's own engine is the reconciler's to stop."""
        await asyncio.gather(*(engine.shutdown(grace) for _, engine in self._remote.values()))
        for node in self.nodes:
            with suppress(KeyError):  # never served a request
                self.metrics.replica_requests_running.remove(self.name, node)


class ReplicaSet:
    """A Model's replicas served as one engine (a ``ServingEngine``, or what the embeddings route
    reads of an ``Embedder``): checked and tokenized here, each request run on one replica."""

    def __init__(self, name: str, task: str, here: str, cluster: Cluster, router: Router, metrics: Metrics,
                 local: Callable[[], ServingEngine | Embedder | None]):
        self.name, self.metrics, self._local = name, metrics, local
        self.replicas = Replicas(name, task, here, cluster, router, metrics, local, lambda: self.tokenizer)
        self.loaded_tokenizer = None  # the Model's tokenizer, loaded on this node
        self.tokenizer_source: tuple[str, str | None] | None = None  # what it is (being) loaded from
        self.failure: str | None = None
        self.fault: str | None = None
        self.faults = 0
        self.vision = None
        self.image_refusal = "images are not routed between a Model's replicas yet"

    async def wake(self) -> bool:
        """Whether some replica is ready, after waking one at zero on a Ready worker if none was."""
        return await self.replicas.wake()

    # -- what every engine has ---------------------------------------------

    @property
    def tokenizer(self):
        local = self._local()
        if self.loaded_tokenizer is not None or local is None:
            return self.loaded_tokenizer
        return local.tokenizer

    @property
    def max_context(self) -> int:
        """The smallest of the replicas' (each sizes its own from its KV budget)."""
        return min((e.max_context for e in self.replicas.ready().values()), default=self.replicas.any().max_context)

    @property
    def vocab_size(self) -> int:
        return self.replicas.any().vocab_size

    @property
    def in_flight(self) -> int:
        replicas = self.replicas
        return sum(replicas.router.in_flight.get((self.name, node), 0) for node in replicas.nodes)

    def start(self) -> None:
        """Nothing to start: each replica's engine is started where it runs."""

    async def shutdown(self, grace: float = 30.0) -> None:
        await self.replicas.shutdown(grace)

    def group_status(self) -> dict | None:
        return None

    def exported_metrics(self) -> str | None:
        return None

    # -- a generation Model: ServingEngine ---------------------------------

    @property
    def speculation(self) -> SpeculationConfig:
        return self.replicas.any().speculation

    @property
    def drafter(self) -> Method | None:
        """The drafter every ready replica has (None unless all have the same)."""
        drafters = {e.drafter for e in self.replicas.ready().values()} or {self.replicas.any().drafter}
        return drafters.pop() if len(drafters) == 1 else None

    def check_prompt(self, request: GenerationRequest) -> None:
        check_request(request, self.name, self.drafter, self.max_context, self.vocab_size)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        node, replica = self.replicas.pick(request.prompt_tokens)
        tokens = self.metrics.replica_tokens
        generated = tokens.labels(self.name, node, "generation")  # looked up once, not at every step
        with self.replicas.serving(node):
            try:
                async for out in replica.generate(request):
                    generated.inc(len(out.tokens))
                    if out.error is not None:
                        self.metrics.replica_failed_requests.labels(self.name, node).inc()
                    elif out.finish_reason is not None:
                        tokens.labels(self.name, node, "prompt").inc(out.prompt_tokens)
                        tokens.labels(self.name, node, "cached").inc(out.cached_tokens)
                    yield out
            except ReplicaUnreachable:
                self.metrics.replica_failed_requests.labels(self.name, node).inc()
                raise

    def set_policy(self, policy: PolicySettings | None, name: str | None) -> None:
        """Each replica's daemon applies policies to its own engine."""

    def speculation_status(self) -> dict:
        return {}

    def prefix_cache_status(self) -> dict:
        return {}

    def kv_cache_status(self) -> dict:
        return {}

    # -- an embedding Model: what the embeddings route reads of an Embedder --

    @property
    def dimensions(self) -> int:
        return self.replicas.any().dimensions

    @property
    def pooling(self):
        return self.replicas.any().pooling

    def check_rows(self, rows: list[list[int]]) -> None:
        check_rows(rows, self.name, self.max_context, self.vocab_size)

    async def embed(self, rows: list[list[int]]) -> np.ndarray:
        node, replica = self.replicas.pick(rows[0] if rows else [])
        with self.replicas.serving(node):
            vectors = await replica.embed(rows)
        self.metrics.replica_tokens.labels(self.name, node, "prompt").inc(sum(map(len, rows)))
        return vectors
