"""The Model reconciler: a Model's desired state (the store) -> its running engine or replicas -> status.

Level-triggered and idempotent, in the manner of controller-runtime: a look at a
Model compares what is desired with what runs and acts on the difference, and
looking twice changes nothing. Slow work (reading a checkpoint's memory request,
loading weights, draining) runs in tasks whose completion queues the Model again;
``reconcile`` returns when to look again unasked (an idle timeout, a backoff).
A Model's DraftPairing and SpecPolicy are applied here, to its engine, between steps;
their own reconcilers report on them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Callable

import structlog

from ...api.manifest import SPEC_PARSERS, ModelSpec, TopologySpec
from ...core.loader import load_tokenizer
from ...core.request import Method, NO_SPECULATION
from ...core.memory import return_freed_memory
from ...engine.interface import ServingEngine, SwappableDrafter
from ...engine.remote import engine_report
from ...parallel.group import GroupClient
from ...parallel.topology import is_local
from ..cluster import Cluster, rank_holder
from ..conditions import condition
from ..download import DownloadProgress
from ..manager import Result
from ..node import Holding, Node
from ..launch import launch
from ..placement import Candidate, Placement, place, place_group, place_remote_groups
from ..registry import ModelRegistry, Pairing, Phase, Policy, ServedModel
from ..replica_set import ReplicaSet
from ..replicas import RemoteReplicas
from ..resources import MemoryRequest, memory_request, rank_request
from ..routing import Router
from ..store import Store, StoredObject
from .draft_pairing import chosen_pairings
from .spec_policy import policy_for, stored_policies

log = structlog.get_logger(__name__)
KIND = "Model"
DOWNLOAD_STATUS_SECONDS = 1.0  # how often a downloading Model's status and metrics follow its progress


def _backoff(restarts: int) -> float:
    """Seconds before restarting a group that failed ``restarts`` times in a row: 1, 2, 4 .. 30."""
    return min(30.0, 2.0 ** (restarts - 1))


def _load_backoff(failures: int) -> float:
    """Seconds before loading again a Model whose load failed ``failures`` times in a row
    for a reason that can pass: 10, 20, 40 .. 300 (Kubernetes' image pull backoff)."""
    return min(300.0, 10.0 * 2.0 ** (failures - 1))


def _request_key(spec: ModelSpec, pairing: Pairing | None, allocatable: int) -> tuple:
    """What a memory request is computed from: the spec, the drafter it loads, the node's size."""
    drafter = pairing.spec.source if pairing is not None and pairing.method != Method.NGRAM else None
    return spec, drafter, allocatable


def can_pass(exc: BaseException) -> bool:
    """Whether a load failure may not happen again: the network or the hub (offline,
    unreachable, rate limited), a file that may yet appear, memory that ran out.
    A bad configuration or an unsupported family stays failed until the spec changes."""
    if isinstance(exc, (OSError, MemoryError, TimeoutError)):  # requests' and the hub's errors are OSErrors
        return True
    text = str(exc).lower()
    return "out of memory" in text or "malloc" in text


class ModelReconciler:
    kind = KIND

    def __init__(self, store: Store, registry: ModelRegistry, enqueue: Callable[[str, str], None],
                 drain_grace: float = 30.0, node: Node | None = None, cluster: Cluster | None = None,
                 routing: str = "prefix"):
        self.store = store
        self.enqueue = enqueue  # the manager's: look at an object of any kind soon
        self.cluster = cluster  # this daemon is a head: Nodes join it, Models' replicas are placed on them
        self.router = Router(routing)
        self.remote = RemoteReplicas(cluster.token, self._spawn) if cluster is not None else None
        self.registry = registry
        self.metrics = registry.metrics
        self.drain_grace = drain_grace
        self.node = node or Node()
        self._background: set[asyncio.Task] = set()
        self._drains: dict[str, asyncio.Task] = {}  # unloads in progress, by Model
        self.head_reserved: dict[str, int] = {}  # on a worker: what the head's groups hold here (their ranks)
        registry.on_demand = self.look
        self.metrics.node_info(self.node.name, self.node.capacity, self.node.allocatable)

    def names(self) -> set[str]:
        return set(self.store.names(KIND)) | set(self.registry.models)

    def look(self, name: str) -> None:
        """Look at the Model soon (callable from any thread: an engine's fault, a request's demand)."""
        self.enqueue(KIND, name)

    def look_at_all(self) -> None:
        """Memory was freed, or the cluster changed: every Model may place differently now."""
        for name in self.names():
            self.look(name)

    def _spawn(self, coro, model: str) -> asyncio.Task:
        """Run slow work for a Model; its end looks at the Model again."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda _: self.look(model))
        return task

    # -- one look --------------------------------------------------------

    def reconcile(self, name: str) -> Result:
        obj = self.store.find(KIND, name)
        if obj is None:
            if name in self.registry.models:
                self._remove(name)
            return Result()
        spec: ModelSpec = SPEC_PARSERS[KIND](obj.spec)
        pairing = chosen_pairings(self.store).get(name)
        policy = policy_for(stored_policies(self.store), obj.labels)
        self._reconcile_model(obj, spec, pairing, policy)
        served = self.registry.models[name]
        if served.engine is not None:
            self._note_faults(served)
            if served.spec.task == "generate":  # speculation is for generation
                if isinstance(served.engine, SwappableDrafter):  # a group's pairing is part of its placement
                    self._reconcile_pairing(served, pairing)
                self._reconcile_policy(served, policy)
        self.store.set_status(KIND, name, self._model_status(obj, served))
        holdings = self.holdings()
        self.metrics.node_memory(self.node.requested(holdings), sum(self.in_use().values()),
                                 sum(1 for m in self.registry.models.values() if m.engine is not None))
        served.notify()
        return Result(self._next_look(served))

    def _next_look(self, served: ServedModel) -> float | None:
        """When to look again unasked: when the Model may go idle, or its backoff ends. A time
        already past was acted on in this look, or waits for a task whose end looks again."""
        now, due = time.monotonic(), []
        if served.engine is not None and served.spec.min_replicas == 0:
            due.append(served.last_used + served.spec.idle_seconds - now)
        if served.retry_at is not None:
            due.append(served.retry_at - now)
        due = [d for d in due if d > 0]
        return min(due) + 0.05 if due else None

    def restart(self, name: str) -> None:
        """``specd rollout restart``: load the Model again now (a failed one skips its backoff,
        a serving one is replaced by a fresh engine once that is ready)."""
        served = self.registry.models[name]
        served.restart, served.failures, served.retry_at = True, 0, None
        if served.engine is None:
            served.phase = Phase.PENDING
        self.store.record_event("Model", name, "Normal", "RestartRequested", "rollout restart")
        self.look(name)

    def node_report(self) -> dict[str, Any]:
        """What a worker tells its head in each heartbeat: its memory and the Models it serves."""
        served = {m.name: {"phase": m.phase.value, "ready": m.engine is not None, "generation": m.generation,
                           "inFlight": m.engine.in_flight if m.engine is not None else 0,
                           "specPolicy": m.policy.name if m.policy is not None else None,
                           **({"engine": engine_report(m.engine)} if m.engine is not None else {})}
                  for m in self.registry.models.values()}
        status = self.node.status(self.holdings(), self.in_use())
        return {"chip": self.node.chip, "allocatable": self.node.allocatable, "capacity": self.node.capacity,
                "status": {**status, "served": served}}

    # -- replicas across the cluster's Nodes ------------------------------

    def _placed_here(self, served: ServedModel, obj: StoredObject, spec: ModelSpec, pairing: Pairing | None,
                     policy: Policy | None) -> bool:
        """On a head: place the Model's replicas on Nodes by its memory request, apply the
        remote ones to their workers; whether this node runs one (if not, and it did, it stops)."""
        current = served.replica_nodes or [r["node"] for r in obj.status.get("replicas", [])]
        request = self._cached_request(served, spec, pairing)
        if request is None:
            served.replica_nodes = current  # a restarted head keeps the placement it stored
            if served.task is None or served.task.done():
                served.task = self._spawn(self._read_request(served, obj.generation, spec, pairing), served.name)
            return False
        members = self.cluster.members
        # what this node could give: idle Models at minReplicas 0 make room when it loads (``_place``)
        mine = self.node.free([h for h in self.holdings() if h.model != served.name and not h.evictable])
        candidates = [Candidate(self.node.name, mine, True)] + [
            Candidate(m.name, self.cluster.free_on(m) + (request.total if m.model(served.name) else 0), m.ready)
            for m in members.values()]
        if self._settling(served, current):
            nodes, short = [n for n in current if n == self.node.name or n in members], ""
        else:
            nodes, short = place(spec.replicas, request.total, current, candidates)
        for gone in set(served.replica_nodes) - set(nodes):
            self.router.forget(served.name, gone)
            self.enqueue("Node", gone)  # what it still runs of the Model is deleted from it
            if gone != self.node.name:
                self.store.record_event("Model", served.name, "Warning", "Rescheduled",
                                        f"replica on Node {gone} moved: the Node is "
                                        f"{'NotReady' if gone in members and not members[gone].ready else 'gone'}")
        served.replica_nodes, served.replicas_short = nodes, short
        self._serve_replicas(served, spec, nodes)
        applied_with = self._applied_with(spec, pairing, policy)
        for node in nodes:
            if node != self.node.name:
                self.remote.ensure(members[node], obj, *applied_with)
        here = self.node.name in nodes
        served.elsewhere = bool(nodes) and not here
        if not here and served.engine is not None:
            self._unload(served, "Rescheduled", "its replica runs on other Nodes")
        if not here:
            served.phase, served.reason = Phase.PENDING, short or f"replicas on {', '.join(nodes)}"
        return here

    def _settling(self, served: ServedModel, nodes: list[str]) -> bool:
        """Whether this head, restarted, has yet to hear from one of these Nodes: then the Model's
        replicas stay where they were placed, and it is looked at again once the Nodes' time is up."""
        wait = max((self.cluster.settling(m) for n in nodes if (m := self.cluster.members.get(n)) is not None),
                   default=0.0)
        if wait > 0:
            asyncio.get_running_loop().call_later(wait + 0.05, self.look, served.name)
        return wait > 0

    def _applied_with(self, spec: ModelSpec, pairing: Pairing | None,
                      policy: Policy | None) -> tuple[StoredObject | None, StoredObject | None]:
        """What a worker is applied with a replica of the Model: the DraftPairing the head chose
        for it and the SpecPolicy that selects it (speculation is for generation)."""
        return (self.store.find("DraftPairing", pairing.name) if pairing else None,
                self.store.find("SpecPolicy", policy.name) if policy and spec.task == "generate" else None)

    def _place_groups(self, served: ServedModel, obj: StoredObject, spec: ModelSpec, topo: StoredObject,
                      topology: TopologySpec, pairing: Pairing | None, policy: Policy | None) -> None:
        """On a head: a group Model's replicas after the group beside the head (``replicas`` > 1)
        are groups whose rank 0 runs on a worker Node of its Topology (``place_remote_groups``).
        The head applies each worker the Model with a Topology of its group's hosts, and the worker
        starts that group as its own; the head reserves what its other ranks hold on Nodes."""
        current = served.remote_groups or {r["node"]: r["hosts"] for r in obj.status.get("replicas", [])
                                           if r["node"] != self.node.name and r.get("hosts")}
        members = {n: m for n, m in self.cluster.members.items() if n != self.node.name}
        request = self._cached_request(served, spec, pairing)
        if spec.replicas > 1 and request is None:  # the look that reads it places them
            served.remote_groups, served.replica_nodes = current, [self.node.name, *current]  # as stored
            return
        groups, short = {}, ""
        if spec.replicas > 1:
            ranks = topology.tensor_parallel_size
            share = rank_request(request, ranks).total
            pool = [h.name for h in topology.hosts[1:] if h.name not in served.group_hosts]
            if self._settling(served, [h for hosts in current.values() for h in hosts]):
                groups = {n: hosts for n, hosts in current.items() if n in members and set(hosts) <= set(pool)}
            else:
                candidates = [Candidate(m.name, self.cluster.free_on(m, rank_holder(served.name))
                                        + (share if m.model(served.name) else 0), m.ready) for m in members.values()]
                groups, short = place_remote_groups(pool, spec.replicas - 1, ranks, share, current, candidates)
            served.remote_group_memory = {h: share for hosts in groups.values() for h in hosts[1:] if h in members}
        else:
            served.remote_group_memory = {}
        for gone in set(served.remote_groups) - set(groups):
            self.router.forget(served.name, gone)
            self.enqueue("Node", gone)  # its group is deleted from it
            lost = [h for h in served.remote_groups[gone] if h in members and not members[h].ready]
            if lost:
                self.store.record_event("Model", served.name, "Warning", "Rescheduled",
                                        f"the group with rank 0 on Node {gone} moved: Node {lost[0]} is NotReady")
        served.remote_groups, served.replicas_short = groups, short
        served.replica_nodes = [self.node.name, *groups] if spec.replicas > 1 else []
        self._reserve_ranks(served)
        if spec.replicas == 1:
            if served.replica_set is not None:  # it had groups elsewhere: only its own serves now
                served.replica_set.nodes = [self.node.name]
            return
        self._serve_replicas(served, spec, served.replica_nodes)
        applied_with = self._applied_with(spec, pairing, policy)
        listed = {h["name"]: h for h in topo.spec["hosts"]}
        for node, hosts in groups.items():
            self.remote.ensure(members[node], obj, *applied_with, {**topo.spec, "hosts": [listed[h] for h in hosts]})

    def _reserve_ranks(self, served: ServedModel) -> None:
        """Reserve on each Node what ranks of the Model's groups that no daemon of that Node placed
        hold there: ranks of the group beside the head, and of its groups elsewhere beside their rank 0."""
        held = dict(served.remote_group_memory)
        for node, bytes_ in served.group_reserved.items():
            held[node] = held.get(node, 0) + bytes_
        self.cluster.reserve(served.name, held)

    def _serve_replicas(self, served: ServedModel, spec: ModelSpec, nodes: list[str]) -> None:
        """On a head: the Model's requests go to its replicas through a ``ReplicaSet``, which
        tokenizes with the Model's tokenizer, loaded here (or its own engine's, meanwhile)."""
        replicas = served.replica_set
        if replicas is None:
            replicas = served.replica_set = ReplicaSet(served.name, spec.task, self.node.name, self.cluster,
                                                       self.router, self.metrics, lambda: served.engine)
        replicas.nodes = nodes
        source = (spec.source, spec.revision)
        if replicas.tokenizer_source != source:
            replicas.tokenizer_source = source
            self._spawn(self._load_tokenizer(replicas, *source), served.name)

    @staticmethod
    async def _load_tokenizer(replicas: ReplicaSet, source: str, revision: str | None) -> None:
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, source, revision)
        except Exception as exc:  # its checkpoint was read for its memory request: this is rare
            log.error("cannot load the tokenizer for the Model's replicas", model=replicas.name, error=str(exc))
            return
        if replicas.tokenizer_source == (source, revision):
            replicas.loaded_tokenizer = tokenizer

    # -- the node's memory -------------------------------------------------

    def holdings(self) -> list[Holding]:
        """What every Model holds on the node: a serving engine's request, a loading one's."""
        out = []
        for m in self.registry.models.values():
            prio = m.spec.priority_value
            if m.request is not None:
                evictable = (m.spec.min_replicas == 0 and not m.demand and m.loading_request is None
                             and m.engine is not None and m.engine.in_flight == 0)
                out.append(Holding(m.name, m.request, False, evictable, prio, m.last_used))
            if m.loading_request is not None:
                out.append(Holding(m.name, m.loading_request, True, False, prio, m.last_used))
        for holder, held in self.head_reserved.items():
            out.append(Holding(holder, MemoryRequest(0, 0, 0, 0, 0, override=held), False, False, 0, 0.0))
        return out

    def reserved_by_head(self, reserved: dict[str, int]) -> None:
        """On a worker: the memory the head's groups hold here now, for ranks it started on this Mac."""
        if reserved != self.head_reserved:
            self.head_reserved = dict(reserved)
            self.look_at_all()  # less room here: a Model waiting for it is told why

    def in_use(self) -> dict[str, int]:
        """What each loaded Model really holds (``model_in_use``)."""
        return {m.name: used for m in self.registry.models.values() if (used := self.model_in_use(m)) is not None}

    @staticmethod
    def model_in_use(m: ServedModel) -> int | None:
        """What a loaded Model really holds: weights, the KV its rows hold, its prefix cache, its drafter."""
        if m.engine is None or m.request is None:
            return None
        used = m.weight_bytes or 0
        if m.spec.task == "generate":
            used += m.engine.kv_cache_status().get("bytes", 0) + m.engine.prefix_cache_status().get("bytes", 0)
            used += m.request.drafter if m.pairing is not None and m.pairing.method != Method.NGRAM else 0
        return used

    def _cached_request(self, served: ServedModel, spec: ModelSpec, pairing: Pairing | None) -> MemoryRequest | None:
        """The spec's memory request, if it was read already (``_read_request``)."""
        key = _request_key(spec, pairing, self.node.allocatable)
        return served.spec_request[1] if served.spec_request is not None and served.spec_request[0] == key else None

    async def _read_request(self, served: ServedModel, generation: int, spec: ModelSpec, pairing: Pairing | None) -> None:
        """Read the spec's memory request from its checkpoint, off the loop (the look after places it).
        A hub checkpoint the cache lacks is downloaded first: meanwhile the Model is ``Downloading``,
        with its progress in status and metrics every ``DOWNLOAD_STATUS_SECONDS``."""
        key = _request_key(spec, pairing, self.node.allocatable)
        progress = served.download = DownloadProgress()
        reading = asyncio.ensure_future(
            asyncio.to_thread(memory_request, spec, key[1], self.node.allocatable, False, progress))
        try:
            while not reading.done():
                await asyncio.wait({reading}, timeout=DOWNLOAD_STATUS_SECONDS)
                if progress.active:
                    if served.engine is None:
                        served.phase, served.reason = Phase.DOWNLOADING, progress.message()
                    self.metrics.model_download(served.name, progress.done, progress.total)
                    self.look(served.name)
            request = reading.result()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._load_failed(served, generation, spec, exc)
            return
        finally:
            served.download = None
            if progress.total:
                self.metrics.model_download(served.name, progress.done, progress.total)
        if served.phase is Phase.DOWNLOADING:
            served.phase, served.reason = Phase.PENDING, "reading its memory request"
        served.spec_request = (key, request)

    def _place(self, served: ServedModel, request: MemoryRequest) -> list[asyncio.Task] | None:
        """Reserve the node's memory for a load: beside what the Model serves now if that fits,
        else in place of it (the old engine drains first); idle Models are unloaded to make
        room if they must be. Returns the unloads to wait for, or None (Unschedulable, with
        the numbers in status) if it cannot fit now."""
        holdings = self.holdings()
        others = [h for h in holdings if h.model != served.name]
        old = [h for h in holdings if h.model == served.name and not h.loading]
        victims = self.node.make_room(request.total, others + old)
        replace = victims is None and bool(old)
        if replace:
            victims = self.node.make_room(request.total, others)
        if victims is None:
            self._refuse(served, self.node.unschedulable(served.name, request.total, others + old))
            return None
        served.unschedulable, served.loading_request = "", request
        for victim in victims:
            self._unload(self.registry.models[victim.model], "Evicted",
                         f"unloaded to make room for {served.name} (priority {victim.priority}, idle)")
        if replace:
            self._unload(served, "Replaced", "unloaded to make room for its new generation")
        names = [v.model for v in victims] + ([served.name] if replace else [])
        return [self._drains[n] for n in names if n in self._drains]

    def _refuse(self, served: ServedModel, message: str) -> None:
        """The Model cannot be placed now: ``Unschedulable``, with the numbers (an event when they change)."""
        if message != served.unschedulable:
            self.store.record_event("Model", served.name, "Warning", "Unschedulable", message)
        served.unschedulable = message
        if served.engine is None:
            served.phase, served.reason = Phase.PENDING, message

    def _group_placement(self, served: ServedModel, topology: TopologySpec, request: MemoryRequest) -> Placement | None:
        """Where a group's ranks run, and its request of this node (the shares of its ranks here).
        Rank 0 runs beside this daemon; the others go to hosts of the Topology (``place_group``):
        its Nodes with room first. ``served.group_memory`` keeps the bytes on each Node, which the
        head reserves there once this node's part is placed. None: too few hosts have room
        (Unschedulable, with the numbers). A host that is neither this node nor a Node of the
        cluster is not counted."""
        ranks, share = topology.tensor_parallel_size, rank_request(request, topology.tensor_parallel_size).total
        members = {n: m for n, m in (self.cluster.members if self.cluster is not None else {}).items()
                   if n != self.node.name}
        candidates = [Candidate(m.name, self.cluster.free_on(m, rank_holder(served.name)), m.ready)
                      for m in members.values()]
        elsewhere = {h for hosts in served.remote_groups.values() for h in hosts}
        pool = [h.name for h in topology.hosts[1:] if h.name not in elsewhere]
        chosen, short = place_group(pool, ranks - 1, share, candidates)
        if short:
            self._refuse(served, short)
            return None
        by_name = {h.name: h for h in topology.hosts}
        hosts = (topology.hosts[0], *(by_name[name] for name in chosen))
        served.group_hosts = [h.name for h in hosts]
        here = sum(h.name not in members and (h.name == self.node.name or is_local(h.address)) for h in hosts)
        served.group_memory = {**({self.node.name: share * here} if here else {}),
                               **{h.name: share for h in hosts if h.name in members}}
        return Placement(rank_request(request, ranks, here), replace(topology, hosts=hosts))

    def _unload(self, served: ServedModel, reason: str, message: str) -> None:
        """Stop routing to the Model's engine and give its memory back once it drained."""
        engine, served.engine, served.request = served.engine, None, None
        served.phase, served.reason = Phase.IDLE, message
        served.pairing, served.policy = None, None
        self.metrics.model_ready.labels(served.name).set(0)
        self.metrics.model_unloads.labels(served.name, reason.lower()).inc()
        log.info("model unloaded", model=served.name, reason=reason)
        self.store.record_event("Model", served.name, "Normal", reason, message)
        self._drains[served.name] = self._spawn(self._drain(served.name, engine), served.name)
        self.look(served.name)

    def _idle(self, served: ServedModel, now: float) -> bool:
        return (served.engine is not None and served.spec.min_replicas == 0 and not served.demand
                and served.loading_generation is None and served.engine.in_flight == 0
                and now - served.last_used >= served.spec.idle_seconds)

    def _reconcile_model(self, obj: StoredObject, spec: ModelSpec, pairing: Pairing | None,
                         policy: Policy | None) -> None:
        served = self.registry.models.get(obj.name)
        if served is None:
            served = ServedModel(obj.name, obj.generation, spec)
            self.registry.models[obj.name] = served
            self.metrics.model_ready.labels(obj.name).set(0)
        now = time.monotonic()
        if served.engine is not None and served.engine.in_flight:
            served.last_used = now
        if self._idle(served, now) and served.generation == obj.generation:
            self._unload(served, "Idle", f"unloaded after {served.spec.idle_seconds:g}s without requests")
        topology, group_key = None, None
        if spec.topology_ref is not None:
            topo = self.store.find("Topology", spec.topology_ref)
            if topo is None:
                if served.engine is None:
                    served.spec, served.generation = spec, obj.generation
                    served.phase, served.reason = Phase.PENDING, f'Topology "{spec.topology_ref}" not found'
                return
            # a group is started for one topology generation and one pairing: either changing restarts it
            topology, group_key = SPEC_PARSERS["Topology"](topo.spec), (topo.name, topo.generation, pairing)
            self._lost_ranks(served)
            self._check_group(served)
            if self.cluster is not None:
                self._place_groups(served, obj, spec, topo, topology, pairing, policy)
        elif served.group_memory or served.remote_groups:  # no longer a group: nothing held for its ranks
            served.group_memory, served.group_reserved, served.group_hosts = {}, {}, []
            served.remote_groups, served.remote_group_memory = {}, {}
            if self.cluster is not None:
                self.cluster.reserve(served.name, {})
        if self.cluster is not None and topology is None and not self._placed_here(served, obj, spec, pairing, policy):
            return
        restart_due = served.retry_at is not None and now >= served.retry_at
        up_to_date = served.generation == obj.generation and served.group_key == group_key and not served.restart and (
            served.engine is not None or served.phase is Phase.FAILED and not restart_due)
        loading_it = served.loading_generation == obj.generation
        if up_to_date or loading_it:
            return
        if served.engine is None and spec.min_replicas == 0 and not served.demand and not served.restart and not (
                served.phase is Phase.FAILED and served.generation == obj.generation):
            served.spec, served.generation, served.unschedulable = spec, obj.generation, ""
            served.phase, served.reason = Phase.IDLE, "minReplicas 0: the first request loads it"
            return
        request = self._cached_request(served, spec, pairing)  # placed on this node by its memory request
        if request is None:
            if served.task is None or served.task.done():
                if served.engine is None and not served.unschedulable:
                    served.phase, served.reason = Phase.PENDING, "reading its memory request"
                served.task = self._spawn(self._read_request(served, obj.generation, spec, pairing), served.name)
            return
        placed = Placement(request)
        if topology is not None:  # a group: its ranks' hosts, and their shares here and on those Nodes
            placed = self._group_placement(served, topology, request)
            if placed is None:
                if self.cluster is not None:
                    served.group_reserved = {}
                    self._reserve_ranks(served)
                return
        drains = self._place(served, placed.request)
        if topology is not None and self.cluster is not None:  # the ranks' shares on other Nodes, once it fits here
            served.group_reserved = {} if drains is None else {
                n: b for n, b in served.group_memory.items() if n != self.node.name}
            self._reserve_ranks(served)
        if drains is None:
            return
        if served.task is not None:
            served.task.cancel()
        served.loading_generation, served.restart = obj.generation, False
        if served.engine is None:  # a restarting group keeps its last failure as the reason
            served.phase, served.reason = Phase.LOADING, served.reason if topology is not None else ""
        served.task = self._spawn(self._load(served, obj.generation, spec, pairing, placed, group_key, drains),
                                  served.name)

    def _note_faults(self, served: ServedModel) -> None:
        """An event for every engine fault since the last look (the engine recovers by itself)."""
        engine = served.engine
        if engine.faults > served.faults_seen:
            self.store.record_event("Model", served.name, "Warning", "EngineFault",
                                    f"{engine.faults - served.faults_seen} failed step(s); last: {engine.fault}")
            served.faults_seen = engine.faults

    def _lost_ranks(self, served: ServedModel) -> None:
        """A running group with a rank on a Node that is NotReady has lost that rank (the Mac is gone
        or cut off): it fails now, and its restart places the rank on a host that is Ready."""
        if not isinstance(served.engine, GroupClient) or self.cluster is None:
            return
        lost = [n for n in served.group_memory if (m := self.cluster.members.get(n)) is not None and not m.ready]
        if lost:
            served.engine.fail(f"Node {', '.join(lost)} is NotReady: its rank is lost")

    def _check_group(self, served: ServedModel) -> None:
        """A failed tensor-parallel group: stop routing to it and schedule a restart (with backoff)."""
        group = served.engine
        if group is None or not group.failure:
            return
        served.engine, served.restarts, served.last_failure = None, served.restarts + 1, group.failure
        served.request = None  # its ranks are killed: the memory is free until the restart places it again
        served.phase, served.reason = Phase.FAILED, group.failure
        served.retry_at = time.monotonic() + _backoff(served.restarts)
        self.metrics.model_ready.labels(served.name).set(0)
        self.store.record_event("Model", served.name, "Warning", "GroupFailed", group.failure)
        self._spawn(group.shutdown(0), served.name)

    async def _load(self, served: ServedModel, generation: int, spec: ModelSpec, pairing: Pairing | None,
                    placed: Placement, group_key: tuple | None, drains: list[asyncio.Task]) -> None:
        """Load a generation of a model; on success switch traffic to it and drain the old engine.

        A local model's memory is reserved already (``_place``); it loads once the Models
        unloaded to make room have drained. A tensor-parallel model is meant to be too big
        for two copies: its old group drains before the new one starts."""
        request = served.loading_request
        started = time.monotonic()
        try:
            await asyncio.gather(*drains)
            log.info("model loading", model=served.name, source=spec.source, generation=generation)
            self.store.record_event("Model", served.name, "Normal", "Loading", f"loading {spec.source}")
            if placed.topology is not None and served.engine is not None:
                old, served.engine, served.phase = served.engine, None, Phase.LOADING
                self.metrics.model_ready.labels(served.name).set(0)
                await self._drain(served.name, old)
            built = await launch(served.name, spec, pairing, placed, self.metrics, lambda: self.look(served.name))
        except asyncio.CancelledError:  # a newer generation replaces this load (and may have reserved already)
            if served.loading_request is request:
                served.loading_request = None
            raise
        except Exception as exc:
            self._load_failed(served, generation, spec, exc, group_key)
            return
        built.engine.start()
        served.request, served.loading_request, served.failures = request, None, 0
        self.metrics.model_load_seconds.labels(served.name).observe(time.monotonic() - started)
        if request is not None:
            self.metrics.model_memory_request.labels(served.name).set(request.total)
        old = served.engine
        served.engine, served.spec, served.generation = built.engine, spec, generation
        served.phase, served.reason, served.loading_generation = Phase.READY, "", None
        served.group_key, served.retry_at, served.faults_seen = group_key, None, 0
        served.load_seconds, served.weight_bytes = time.monotonic() - started, built.weight_bytes
        served.pairing = pairing if spec.task == "generate" else None
        served.pairing_error, served.policy = built.pairing_error, None
        if built.pairing_error:
            self.store.record_event("DraftPairing", pairing.name, "Warning", "DraftLoadFailed", built.pairing_error)
        self.metrics.model_ready.labels(served.name).set(1)
        self.metrics.model_loaded(served.name, built.weight_bytes)
        log.info("model ready", model=served.name, generation=generation, seconds=round(served.load_seconds, 2))
        self.store.record_event("Model", served.name, "Normal", "Ready",
                                f"serving generation {generation} ({served.load_seconds:.2f}s to load)")
        if old is not None:
            self._spawn(self._drain(served.name, old), served.name)

    def _load_failed(self, served: ServedModel, generation: int, spec: ModelSpec, exc: Exception,
                     group_key: tuple | None = None) -> None:
        """A load (or the read of its memory request) failed: retried with backoff if it can
        pass, else Failed until the spec changes or a rollout restart."""
        reason = f"{type(exc).__name__}: {exc}"
        log.error("model failed to load", model=served.name, reason=reason)
        served.loading_generation, served.generation, served.restart = None, generation, False
        served.group_key, served.loading_request = group_key, None
        if group_key is not None:  # a group start can fail for passing reasons (a host rebooting)
            served.restarts += 1
            served.retry_at = time.monotonic() + _backoff(served.restarts)
        elif can_pass(exc):
            served.failures += 1
            delay = _load_backoff(served.failures)
            served.retry_at = time.monotonic() + delay
            reason += f" (attempt {served.failures}; next in {delay:.0f}s)"
        else:
            served.retry_at = None
        self.store.record_event("Model", served.name, "Warning",
                                "BackOff" if served.retry_at and group_key is None else "LoadFailed", reason)
        if served.engine is None:
            served.phase, served.spec = Phase.FAILED, spec
        served.reason = reason

    async def _drain(self, name: str, engine: ServingEngine) -> None:
        await engine.shutdown(self.drain_grace)
        log.info("engine drained", model=name)
        del engine  # the last reference: the weights and caches are freed here, then handed back
        await asyncio.to_thread(return_freed_memory)
        if self._drains.get(name) is asyncio.current_task():
            del self._drains[name]
        self.look_at_all()  # the memory it held may place another Model

    def _remove(self, name: str) -> None:
        """The Model was deleted: stop routing to it, let in-flight requests finish."""
        served = self.registry.models.pop(name)
        if served.task is not None:
            served.task.cancel()
        self.metrics.forget_model(name)
        if served.engine is not None:
            self._spawn(self._drain(name, served.engine), name)
        if served.replica_set is not None:
            self._spawn(served.replica_set.shutdown(self.drain_grace), name)
        if self.cluster is not None:
            self.cluster.reserve(name, {})  # its group's ranks elsewhere
            for member in self.cluster.ready():  # its replicas there are deleted
                self.enqueue("Node", member.name)
        log.info("model removed", model=name)

    def _reconcile_pairing(self, served: ServedModel, pairing: Pairing | None) -> None:
        if served.pairing == pairing or served.task is not None and not served.task.done():
            return
        if pairing is None:
            served.engine.configure_speculation(NO_SPECULATION, None)
            served.pairing = None
            return
        current = served.pairing
        method = pairing.method
        same_drafter = (current is not None and current.method == method
                        and current.spec.source == pairing.spec.source and not served.pairing_error)
        if method == Method.NGRAM or same_drafter:
            drafter = served.engine.drafter_module if same_drafter else None
            served.engine.configure_speculation(pairing.speculation(), drafter)
            served.pairing, served.pairing_error = pairing, ""
            return
        served.task = self._spawn(self._attach_draft(served, pairing), served.name)

    async def _attach_draft(self, served: ServedModel, pairing: Pairing) -> None:
        engine = served.engine
        try:
            draft = await asyncio.to_thread(engine.load_drafter, pairing.method, pairing.spec.source, pairing.name)
        except Exception as exc:
            served.pairing_error = f"{type(exc).__name__}: {exc}"
            served.pairing = pairing  # do not retry until the pairing changes
            self.store.record_event("DraftPairing", pairing.name, "Warning", "DraftLoadFailed", served.pairing_error)
            engine.configure_speculation(NO_SPECULATION, None)
            return
        engine.configure_speculation(pairing.speculation(), draft)
        served.pairing, served.pairing_error = pairing, ""
        self.store.record_event("DraftPairing", pairing.name, "Normal", "Attached", f"drafting for {served.name}")

    def _reconcile_policy(self, served: ServedModel, policy: Policy | None) -> None:
        """The first policy (by name) whose selector matches the Model's labels, applied to its engine."""
        if served.policy == policy:
            return
        m = self.metrics
        if served.policy is not None:
            for gauge in (m.spec_policy_enabled, m.spec_policy_max_tokens, m.spec_policy_generation):
                gauge.remove(served.name, served.policy.name)
        served.engine.set_policy(policy.settings() if policy else None, policy.name if policy else None)
        served.policy = policy
        if policy is not None:
            m.spec_policy_enabled.labels(served.name, policy.name).set(1 if policy.spec.enabled else 0)
            m.spec_policy_max_tokens.labels(served.name, policy.name).set(policy.spec.max_speculative_tokens)
            m.spec_policy_generation.labels(served.name, policy.name).set(policy.generation)
            self.store.record_event("Model", served.name, "Normal", "PolicyApplied",
                                    f"SpecPolicy {policy.name} generation {policy.generation}")

    # -- status ----------------------------------------------------------

    def _model_status(self, obj: StoredObject, served: ServedModel | None) -> dict[str, Any]:
        if served is None:
            return obj.status
        ready = served.engine is not None
        if ready and served.unschedulable:
            reason, message = "Unschedulable", f"serving generation {served.generation}; the new spec {served.unschedulable}"
        elif ready and served.loading_generation is not None:
            reason, message = "Reloading", f"serving generation {served.generation}, loading {served.loading_generation}"
        elif ready:
            reason, message = "Loaded", f"serving {served.spec.source}"
        else:
            reason = {Phase.FAILED: "LoadFailed", Phase.LOADING: "Loading", Phase.IDLE: "ScaledToZero",
                      Phase.DOWNLOADING: "Downloading"}.get(served.phase, "Pending")
            if served.unschedulable:
                reason = "Unschedulable"
            elif served.retry_at is not None:
                reason = "Restarting" if served.spec.topology_ref is not None else "BackOff"
            message = served.reason or served.phase.value
        status: dict[str, Any] = {
            "observedGeneration": obj.generation, "phase": served.phase.value,
            "conditions": [condition("Ready", ready, reason, message, obj.generation, obj.status)]}
        status["conditions"].append(self._degraded(obj, served))
        if served.retry_at is not None and not ready:
            status["nextAttemptSeconds"] = max(0, round(served.retry_at - time.monotonic()))
        if served.download is not None and served.download.active:
            status["download"] = served.download.as_dict()
        request = served.request or served.loading_request or (served.spec_request or (None, None))[1]
        if request is not None:
            status["resources"] = {"requests": request.as_dict(), "inUse": self.model_in_use(served),
                                   "node": self.node.name}
        status["scaling"] = {"minReplicas": served.spec.min_replicas, "idleSeconds": served.spec.idle_seconds,
                             "priority": served.spec.priority, "replicas": 1 if ready else 0}
        if self.cluster is None and served.spec.replicas > 1:
            status["conditions"].append(condition(
                "Scheduled", False, "Unschedulable", f"{served.spec.replicas - 1} of {served.spec.replicas} replicas "
                "fit no Node: this daemon is one Node (start it as a cluster head, docs/cluster.md)",
                obj.generation, obj.status))
        if self.cluster is not None and (served.spec.topology_ref is None or served.spec.replicas > 1):
            routable = set(served.replica_set.ready_nodes()) if served.replica_set is not None else set()
            policies = served.replica_set.policies() if served.replica_set is not None else {}
            phases = served.replica_set.phases() if served.replica_set is not None else {}
            status["replicas"] = [{"node": n, "ready": n in routable,
                                   "phase": served.phase.value if n == self.node.name else phases.get(n, "Pending"),
                                   **({"specPolicy": policies[n]} if policies.get(n) else {}),
                                   **({"hosts": served.remote_groups.get(n, served.group_hosts)}
                                      if served.spec.topology_ref else {})}
                                  for n in served.replica_nodes]
            status["readyReplicas"] = len(routable)
            if served.replicas_short:
                status["conditions"].append(condition("Scheduled", False, "Unschedulable", served.replicas_short,
                                                      obj.generation, obj.status))
            ready = bool(routable)
            status["conditions"][0] = condition(
                "Ready", ready, "ReplicasReady" if ready else status["conditions"][0]["reason"],
                f"{len(routable)} of {served.spec.replicas} replicas ready" if ready else status["conditions"][0]["message"],
                obj.generation, obj.status)
        if served.engine is not None and served.engine.faults:
            status["faults"] = served.engine.faults
        if served.spec.topology_ref is not None:
            running = served.engine.group_status() if served.engine is not None else None
            status["group"] = {"topology": served.spec.topology_ref, "restarts": served.restarts,
                               "lastFailure": served.last_failure or None, "memory": served.group_memory,
                               **(running or {"ranks": [], "steps": None, "controlBytes": None})}
        if served.load_seconds is not None:
            status.update(loadSeconds=round(served.load_seconds, 3), weightBytes=served.weight_bytes,
                          servedGeneration=served.generation)
        if served.pairing is not None:
            status["draftPairing"] = served.pairing.name
        if served.policy is not None:
            status["specPolicy"] = {"name": served.policy.name, "generation": served.policy.generation,
                                    "mode": served.policy.spec.mode,
                                    "maxSpeculativeTokens": served.policy.spec.max_speculative_tokens,
                                    "enabled": served.policy.spec.enabled}
        if served.engine is not None and served.spec.task == "embed":
            status["embedding"] = {"dimensions": served.engine.dimensions, "pooling": served.engine.pooling.mode,
                                   "normalized": served.engine.pooling.normalize}
        elif served.engine is not None:
            spec_status = dict(served.engine.speculation_status())
            spec_status.pop("acceptanceRate", None)  # the DraftPairing's status carries it
            status["speculation"] = spec_status
            status["prefixCache"] = served.engine.prefix_cache_status()
            status["kvCache"] = served.engine.kv_cache_status()
        return status

    @staticmethod
    def _degraded(obj: StoredObject, served: ServedModel) -> dict[str, Any]:
        """A model is Degraded while its last engine step failed (until one
        succeeds), a tensor-parallel one while its group is down and being restarted."""
        if served.spec.topology_ref is None:
            if served.engine is None:
                return condition("Degraded", False, "NotServing", f"no engine runs: {served.phase.value}",
                                 obj.generation, obj.status)
            fault = served.engine.fault
            if fault is not None:
                return condition("Degraded", True, "EngineFault", fault, obj.generation, obj.status)
            return condition("Degraded", False, "Serving", "no engine fault since the last successful step",
                             obj.generation, obj.status)
        down = served.engine is None and served.retry_at is not None
        if down:
            return condition("Degraded", True, "GroupFailed", served.reason, obj.generation, obj.status)
        message = (f"all ranks up; restarted {served.restarts} times, last failure: {served.last_failure}"
                   if served.restarts else "all ranks up")
        return condition("Degraded", False, "AllRanksUp", message, obj.generation, obj.status)
