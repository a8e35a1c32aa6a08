"""The Model reconciler: a Model's desired state (the store) -> its running engine or replicas -> status.

Level-triggered and idempotent, in the manner of controller-runtime: a look at a
Model compares what is desired with what runs and acts on the difference, and
looking twice changes nothing. Slow work (reading a checkpoint's memory request,
loading weights, draining) runs in tasks whose completion queues the Model again;
``reconcile`` returns when to look again unasked (an idle timeout, a backoff).
Its parts: the node's memory (``memory``), replicas on a cluster's Nodes
(``replicas``) and groups' ranks (``groups``), engines loading and draining
(``lifecycle``), the drafter and policy applied to a running engine
(``speculation``), and status (``status``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

from ....api.manifest import SPEC_PARSERS, ModelSpec
from ....engine.interface import SwappableDrafter
from ....serving.cluster import Cluster
from ....serving.registry import ModelRegistry, Phase, ServedModel
from ....store import Store
from ...manager import Result
from ...node import Holding, Node
from ...placement import Placement
from ...state import Desired, ModelState, Placed, Running
from ..draft_pairing import chosen_pairings
from ..spec_policy import policy_for, stored_policies
from .context import KIND, ModelContext
from .groups import GroupPlacement
from .lifecycle import Lifecycle
from .memory import NodeMemory
from .replicas import ReplicaPlacement
from .speculation import SpeculationSettings
from .status import model_status, node_report


def scaled_only(running: ModelSpec, desired: ModelSpec) -> bool:
    """Whether two specs differ in how many copies run and when only (``replicas``, ``scaling``):
    that change places or removes replicas and leaves a running engine as it is."""
    return replace(running, replicas=desired.replicas, min_replicas=desired.min_replicas,
                   idle_seconds=desired.idle_seconds, priority=desired.priority) == desired


class ModelReconciler:
    kind = KIND

    def __init__(self, store: Store, registry: ModelRegistry, enqueue: Callable[[str, str], None],
                 drain_grace: float = 30.0, node: Node | None = None, cluster: Cluster | None = None,
                 routing: str = "prefix"):
        self.ctx = ctx = ModelContext(store, registry, enqueue, node or Node(), cluster, drain_grace)
        self.lifecycle = Lifecycle(ctx)
        self.memory = NodeMemory(ctx, self.lifecycle)
        self.replicas = ReplicaPlacement(ctx, self.memory, self.lifecycle, routing) if cluster is not None else None
        self.groups = GroupPlacement(ctx, self.memory, self.replicas)
        self.speculation = SpeculationSettings(ctx)
        registry.on_demand = ctx.look
        ctx.metrics.node_info(ctx.node.name, ctx.node.capacity, ctx.node.allocatable)
        ctx.metrics.node_memory_from(lambda: ctx.node.requested(self.memory.holdings()),
                                     lambda: sum(self.memory.in_use().values()),
                                     lambda: sum(1 for m in ctx.states.values() if m.serving.engine is not None))

    # what other parts of the daemon ask of it
    @property
    def states(self) -> dict[str, ModelState]:
        return self.ctx.states

    @property
    def node(self) -> Node:
        return self.ctx.node

    def names(self) -> set[str]:
        return self.ctx.names()

    def look(self, name: str) -> None:
        self.ctx.look(name)

    def look_at_all(self) -> None:
        self.ctx.look_at_all()

    def holdings(self) -> list[Holding]:
        return self.memory.holdings()

    def in_use(self) -> dict[str, int]:
        return self.memory.in_use()

    def reserved_by_head(self, reserved: dict[str, int]) -> None:
        self.memory.reserved_by_head(reserved)

    def node_report(self) -> dict[str, Any]:
        return node_report(self.ctx, self.memory)

    def restart(self, name: str) -> None:
        """``specd rollout restart``: load the Model again now (a failed one skips its backoff,
        a serving one is replaced by a fresh engine once that is ready)."""
        state = self.ctx.states[name]
        state.running.restart, state.running.failures, state.serving.retry_at = True, 0, None
        if state.serving.engine is None:
            state.serving.phase = Phase.PENDING
        self.ctx.event(name, "Normal", "RestartRequested", "rollout restart")
        self.look(name)

    # -- one look --------------------------------------------------------

    def reconcile(self, name: str) -> Result:
        ctx = self.ctx
        want = self._desired(name)
        if want is None:
            if name in ctx.states:
                self.lifecycle.remove(name)
            return Result()
        state = self._state(want)
        self._reconcile_model(state, want)
        engine = state.serving.engine
        if engine is not None:
            self.lifecycle.note_faults(state)
            if state.running.spec.task == "generate":  # speculation is for generation
                if isinstance(engine, SwappableDrafter):  # a group's pairing is part of its placement
                    self.speculation.pairing(state, want.pairing)
                self.speculation.policy(state, want.policy)
        ctx.store.set_status(KIND, name, model_status(ctx, want.obj, state))
        state.serving.notify()
        return Result(self._next_look(state))

    def _desired(self, name: str) -> Desired | None:
        store = self.ctx.store
        obj = store.find(KIND, name)
        if obj is None:
            return None
        spec: ModelSpec = SPEC_PARSERS[KIND](obj.spec)
        pairing = chosen_pairings(store).get(name)
        policy = policy_for(stored_policies(store), obj.labels)
        topology = store.find("Topology", spec.topology_ref) if spec.topology_ref is not None else None
        return Desired(obj, spec, pairing, policy, topology,
                       SPEC_PARSERS["Topology"](topology.spec) if topology is not None else None)

    def _state(self, want: Desired) -> ModelState:
        """The Model's state, made at its first look (and its entry in the serving registry)."""
        ctx, name = self.ctx, want.obj.name
        state = ctx.states.get(name)
        if state is None:
            served = ServedModel(name, want.spec.task)
            state = ctx.states[name] = ModelState(served, Running(want.generation, want.spec))
            ctx.registry.models[name] = served
            ctx.metrics.model_ready.labels(name).set(0)
        state.serving.task = state.running.spec.task
        return state

    def _next_look(self, state: ModelState) -> float | None:
        """When to look again unasked: when the Model may go idle, or its backoff ends. A time
        already past was acted on in this look, or waits for a task whose end looks again."""
        served, spec = state.serving, state.running.spec
        now, due = time.monotonic(), []
        if served.engine is not None and spec.min_replicas == 0:
            due.append(served.last_used + spec.idle_seconds - now)
        if served.retry_at is not None:
            due.append(served.retry_at - now)
        due = [d for d in due if d > 0]
        return min(due) + 0.05 if due else None

    def _reconcile_model(self, state: ModelState, want: Desired) -> None:
        served, running, spec = state.serving, state.running, want.spec
        now = time.monotonic()
        if served.engine is not None and served.engine.in_flight:
            served.last_used = now
        if self.lifecycle.idle(state, now) and running.generation == want.generation:
            self.lifecycle.unload(state, "Idle", f"unloaded after {running.spec.idle_seconds:g}s without requests")
        if running.generation != want.generation and served.engine is not None and not running.restart and (
                running.loading_generation is None and scaled_only(running.spec, spec)):
            running.spec, running.generation = spec, want.generation  # placed or removed elsewhere, not reloaded
        if not self._reconcile_placement(state, want):
            return
        up_to_date = running.generation == want.generation and running.group_key == want.group_key and (
            not running.restart and served.engine is not None
            or self.lifecycle.waits_after_failure(state, want.generation, now))
        if up_to_date or running.loading_generation == want.generation:
            return
        if served.engine is None and spec.min_replicas == 0 and not served.demand and not running.restart and not (
                served.phase is Phase.FAILED and running.generation == want.generation):
            running.spec, running.generation, served.unschedulable = spec, want.generation, ""
            served.phase, served.reason = Phase.IDLE, "minReplicas 0: the first request loads it"
            return
        self._load_if_it_fits(state, want)

    def _reconcile_placement(self, state: ModelState, want: Desired) -> bool:
        """A group's ranks, or a head's replicas, placed; whether this node runs the Model."""
        ctx, served, placed, spec = self.ctx, state.serving, state.placed, want.spec
        if spec.topology_ref is not None:
            if want.topology is None:
                if served.engine is None:
                    state.running.spec, state.running.generation = spec, want.generation
                    served.phase, served.reason = Phase.PENDING, f'Topology "{spec.topology_ref}" not found'
                return False
            self.lifecycle.lost_ranks(state)
            self.lifecycle.check_group(state)
            if ctx.cluster is not None:
                self.groups.place_remote(state, want)
            return True
        if placed.group_memory or placed.remote_groups:  # no longer a group: nothing held for its ranks
            state.placed = Placed(replica_nodes=placed.replica_nodes, replicas_short=placed.replicas_short)
            if ctx.cluster is not None:
                ctx.cluster.reserve(state.name, {})
        return ctx.cluster is None or self.replicas.placed_here(state, want)

    def _load_if_it_fits(self, state: ModelState, want: Desired) -> None:
        """Load the desired generation once its memory request is read and fits this node."""
        ctx, served, running = self.ctx, state.serving, state.running
        request = self.memory.cached_request(state, want.spec, want.pairing)
        if request is None:
            if (running.task is None or running.task.done()) and served.engine is None and not served.unschedulable:
                served.phase, served.reason = Phase.PENDING, "reading its memory request"
            self.memory.start_reading(state, want.generation, want.spec, want.pairing)
            return
        placement = Placement(request)
        if want.topology is not None:  # a group: its ranks' hosts, and their shares here and on those Nodes
            placement = self.groups.placement(state, want, request)
            if placement is None:
                if ctx.cluster is not None:
                    state.placed.group_reserved = {}
                    self.groups.reserve_ranks(state)
                return
        drains = self.memory.place(state, placement.request)
        if want.topology is not None and ctx.cluster is not None:  # the ranks' shares elsewhere, once it fits here
            state.placed.group_reserved = {} if drains is None else {
                n: b for n, b in state.placed.group_memory.items() if n != ctx.node.name}
            self.groups.reserve_ranks(state)
        if drains is None:
            return
        if running.task is not None:
            running.task.cancel()
        running.loading_generation, running.restart = want.generation, False
        if served.engine is None:  # a restarting group keeps its last failure as the reason
            served.phase, served.reason = Phase.LOADING, served.reason if want.topology is not None else ""
        running.task = ctx.spawn(self.lifecycle.load(state, want.generation, want.spec, want.pairing, placement,
                                                     want.group_key, drains), state.name)
