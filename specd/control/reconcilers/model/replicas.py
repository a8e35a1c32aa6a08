"""On a head: a Model's replicas placed on the cluster's Nodes by its memory request, the
remote ones applied to their workers, and its requests served through a ``ReplicaSet``."""

from __future__ import annotations

import asyncio
import time

import structlog

from ....api.manifest import ModelSpec
from ....core.loader import load_tokenizer
from ....serving.registry import Phase
from ....serving.replica_set import ReplicaSet
from ....serving.routing import Router
from ....store import StoredObject
from ...placement import Candidate, place
from ...replicas import RemoteReplicas
from ...state import Desired, ModelState
from .context import ModelContext
from .lifecycle import Lifecycle
from .memory import NodeMemory

log = structlog.get_logger(__name__)


class ReplicaPlacement:
    def __init__(self, ctx: ModelContext, memory: NodeMemory, lifecycle: Lifecycle, routing: str):
        self.ctx, self.memory, self.lifecycle = ctx, memory, lifecycle
        self.router = Router(routing)
        self.remote = RemoteReplicas(ctx.cluster.session, ctx.spawn) if ctx.cluster is not None else None

    def placed_here(self, state: ModelState, want: Desired) -> bool:
        """Place the Model's replicas on Nodes by its memory request, apply the remote ones to
        their workers; whether this node runs one (if not, and it did, it stops)."""
        ctx, placed, obj, spec = self.ctx, state.placed, want.obj, want.spec
        node, cluster = ctx.node, ctx.cluster
        self.router.keeps_on_disk(state.name, spec.prefix_cache_disk is not None)
        current = placed.replica_nodes or [r["node"] for r in obj.status.get("replicas", [])]
        request = self.memory.cached_request(state, spec, want.pairing)
        if request is None:
            placed.replica_nodes = current  # a restarted head keeps the placement it stored
            if not self.lifecycle.waits_after_failure(state, obj.generation, time.monotonic()):
                self.memory.start_reading(state, obj.generation, spec, want.pairing)
            return False
        members = cluster.members
        # what this node could give: idle Models at minReplicas 0 make room when it loads (``NodeMemory.place``)
        mine = node.free([h for h in self.memory.holdings() if h.model != state.name and not h.evictable])
        candidates = [Candidate(node.name, mine, True)] + [
            Candidate(m.name, cluster.free_on(m) + (request.total if m.model(state.name) else 0), m.ready)
            for m in members.values()]
        if self.settling(state, current):
            nodes, short = [n for n in current if n == node.name or n in members], ""
        else:
            nodes, short = place(spec.replicas, request.total, current, candidates)
        gone, new = sorted(set(placed.replica_nodes) - set(nodes)), sorted(set(nodes) - set(placed.replica_nodes))
        epoch = self.advance_epoch(state, obj, nodes)
        for name in gone:
            self.router.forget(state.name, name)
            ctx.enqueue("Node", name)  # what it still runs of the Model is deleted from it
            if name != node.name and new:  # an event when a replica moved, not when one was only removed
                ctx.event(state.name, "Warning", "Rescheduled", f"replica on Node {name} moved to Node {new.pop(0)}: "
                          f"the Node is {'NotReady' if name in members and not members[name].ready else 'gone'}")
        placed.replica_nodes, placed.replicas_short = nodes, short
        self.serve_replicas(state, spec, nodes, epoch)
        applied_with = self.applied_with(want)
        for name in nodes:
            if name != node.name:
                self.remote.ensure(members[name], obj, *applied_with, epoch=epoch)
        here = node.name in nodes
        state.serving.elsewhere = bool(nodes) and not here
        if not here and state.serving.engine is not None:
            self.lifecycle.unload(state, "Rescheduled", "its replica runs on other Nodes")
        if not here:
            state.serving.phase, state.serving.reason = Phase.PENDING, short or f"replicas on {', '.join(nodes)}"
        return here

    def advance_epoch(self, state: ModelState, obj: StoredObject, nodes: list[str]) -> int:
        """The Model's placement epoch with its replicas on ``nodes``: the next one when the Nodes
        change (a restarted head goes on from the one it stored), told to the cluster's Nodes."""
        placed = state.placed
        if placed.epoch is None:
            placed.epoch = obj.status.get("placementEpoch", 0)
        if set(nodes) != set(placed.replica_nodes):
            placed.epoch += 1
        self.ctx.cluster.place(state.name, placed.epoch, nodes)
        return placed.epoch

    def settling(self, state: ModelState, nodes: list[str]) -> bool:
        """Whether this head, restarted, has yet to hear from one of these Nodes: then the Model's
        replicas stay where they were placed, and it is looked at again once the Nodes' time is up."""
        cluster = self.ctx.cluster
        wait = max((cluster.settling(m) for n in nodes if (m := cluster.members.get(n)) is not None), default=0.0)
        if wait > 0:
            asyncio.get_running_loop().call_later(wait + 0.05, self.ctx.look, state.name)
        return wait > 0

    def applied_with(self, want: Desired) -> tuple[StoredObject | None, StoredObject | None]:
        """What a worker is applied with a replica of the Model: the DraftPairing the head chose
        for it and the SpecPolicy that selects it (speculation is for generation)."""
        store, pairing, policy = self.ctx.store, want.pairing, want.policy
        return (store.find("DraftPairing", pairing.name) if pairing else None,
                store.find("SpecPolicy", policy.name) if policy and want.spec.task == "generate" else None)

    def serve_replicas(self, state: ModelState, spec: ModelSpec, nodes: list[str], epoch: int) -> None:
        """The Model's requests go to its replicas through a ``ReplicaSet``, which tokenizes
        with the Model's tokenizer, loaded here (or its own engine's, meanwhile)."""
        ctx, served = self.ctx, state.serving
        replica_set = served.replica_set
        if replica_set is None:
            replica_set = served.replica_set = ReplicaSet(state.name, spec.task, ctx.node.name, ctx.cluster,
                                                          self.router, ctx.metrics, lambda: served.engine)
        replica_set.replicas.nodes, replica_set.replicas.epoch = nodes, epoch
        source = (spec.source, spec.revision)
        if replica_set.tokenizer_source != source:
            replica_set.tokenizer_source = source
            ctx.spawn(self._load_tokenizer(replica_set, *source), state.name)

    @staticmethod
    async def _load_tokenizer(replicas: ReplicaSet, source: str, revision: str | None) -> None:
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, source, revision)
        except Exception as exc:  # its checkpoint was read for its memory request: this is rare
            log.error("cannot load the tokenizer for the Model's replicas", model=replicas.name, error=str(exc))
            return
        if replicas.tokenizer_source == (source, revision):
            replicas.loaded_tokenizer = tokenizer
