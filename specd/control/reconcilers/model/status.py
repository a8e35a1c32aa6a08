"""A Model's status, written at every look: its conditions (each for the generation whose
outcome it describes), its replicas, memory, group, drafter, policy and caches; and what a
worker reports of its Models to its head."""

from __future__ import annotations

import time
from typing import Any

from ....serving.registry import Phase
from ....serving.remote import engine_report
from ....store import StoredObject
from ...conditions import condition
from ...state import ModelState
from .context import ModelContext
from .memory import NodeMemory, model_in_use


def _ready(obj: StoredObject, state: ModelState) -> dict[str, Any]:
    """Whether the Model serves, and why (not): the reason names the phase, the message the numbers."""
    served, running = state.serving, state.running
    ready = served.engine is not None
    if ready and served.unschedulable:
        reason, message = "Unschedulable", f"serving generation {running.generation}; the new spec {served.unschedulable}"
    elif ready and running.loading_generation is not None:
        reason, message = "Reloading", f"serving generation {running.generation}, loading {running.loading_generation}"
    elif ready:
        reason, message = "Loaded", f"serving {running.spec.source}"
    else:
        reason = {Phase.FAILED: "LoadFailed", Phase.LOADING: "Loading", Phase.IDLE: "ScaledToZero",
                  Phase.DOWNLOADING: "Downloading"}.get(served.phase, "Pending")
        if served.unschedulable:
            reason = "Unschedulable"
        elif served.retry_at is not None:
            reason = "Restarting" if running.spec.topology_ref is not None else "BackOff"
        message = served.reason or served.phase.value
    return condition("Ready", ready, reason, message, obj.generation, obj.status)


def _degraded(obj: StoredObject, state: ModelState) -> dict[str, Any]:
    """A model is Degraded while its last engine step failed (until one succeeds), a
    tensor-parallel one while its group is down and being restarted."""
    served, running = state.serving, state.running
    if running.spec.topology_ref is None:
        if served.engine is None:
            return condition("Degraded", False, "NotServing", f"no engine runs: {served.phase.value}",
                             obj.generation, obj.status)
        fault = served.engine.fault
        if fault is not None:
            return condition("Degraded", True, "EngineFault", fault, obj.generation, obj.status)
        return condition("Degraded", False, "Serving", "no engine fault since the last successful step",
                         obj.generation, obj.status)
    if served.engine is None and served.retry_at is not None:
        return condition("Degraded", True, "GroupFailed", served.reason, obj.generation, obj.status)
    message = (f"all ranks up; restarted {running.restarts} times, last failure: {running.last_failure}"
               if running.restarts else "all ranks up")
    return condition("Degraded", False, "AllRanksUp", message, obj.generation, obj.status)


def _replicas(obj: StoredObject, state: ModelState, node_name: str, status: dict[str, Any]) -> None:
    """On a head: each replica's Node and readiness; Ready when any replica is."""
    served, placed, spec = state.serving, state.placed, state.running.spec
    replicas = served.replica_set.replicas if served.replica_set is not None else None
    routable = set(replicas.ready_nodes()) if replicas is not None else set()
    policies = replicas.policies() if replicas is not None else {}
    phases = replicas.phases() if replicas is not None else {}
    status["replicas"] = [{"node": n, "ready": n in routable,
                           "phase": served.phase.value if n == node_name else phases.get(n, "Pending"),
                           **({"specPolicy": policies[n]} if policies.get(n) else {}),
                           **({"hosts": placed.remote_groups.get(n, placed.group_hosts)} if spec.topology_ref else {})}
                          for n in placed.replica_nodes]
    status["readyReplicas"] = len(routable)
    if placed.epoch is not None:
        status["placementEpoch"] = placed.epoch
    if placed.replicas_short:
        status["conditions"].append(condition("Scheduled", False, "Unschedulable", placed.replicas_short,
                                              obj.generation, obj.status))
    ready = bool(routable)
    if served.elsewhere:  # the head runs no engine of it: its phase and health are its replicas'
        loading = any(p == Phase.LOADING.value for p in phases.values())
        status["phase"] = (Phase.READY if ready else Phase.LOADING if loading else served.phase).value
        where = ", ".join(placed.replica_nodes) or "no Node yet"
        status["conditions"][1] = condition("Degraded", False, "ServedElsewhere", f"its replicas run on {where}; "
                                            "each Node reports its own engine's faults", obj.generation, obj.status)
    first = status["conditions"][0]
    status["conditions"][0] = condition(
        "Ready", ready, "ReplicasReady" if ready else first["reason"],
        f"{len(routable)} of {spec.replicas} replicas ready" if ready else first["message"],
        obj.generation, obj.status)


def _running(state: ModelState, status: dict[str, Any]) -> None:
    """What the running engine reports: its group, load, drafter, policy, speculation and caches."""
    served, running = state.serving, state.running
    engine, spec = served.engine, running.spec
    if engine is not None and engine.faults:
        status["faults"] = engine.faults
    if spec.topology_ref is not None:
        group = engine.group_status() if engine is not None else None
        status["group"] = {"topology": spec.topology_ref, "restarts": running.restarts,
                           "lastFailure": running.last_failure or None, "memory": state.placed.group_memory,
                           **(group or {"ranks": [], "steps": None, "controlBytes": None})}
    if running.load_seconds is not None:
        status.update(loadSeconds=round(running.load_seconds, 3), weightBytes=running.weight_bytes,
                      servedGeneration=running.generation)
    if running.pairing is not None:
        status["draftPairing"] = running.pairing.name
    if running.policy is not None:
        policy = running.policy
        status["specPolicy"] = {"name": policy.name, "generation": policy.generation, "mode": policy.spec.mode,
                                "maxSpeculativeTokens": policy.spec.max_speculative_tokens,
                                "enabled": policy.spec.enabled}
    if engine is not None and spec.task == "embed":
        status["embedding"] = {"dimensions": engine.dimensions, "pooling": engine.pooling.mode,
                               "normalized": engine.pooling.normalize}
    elif engine is not None:
        spec_status = dict(engine.speculation_status())
        spec_status.pop("acceptanceRate", None)  # the DraftPairing's status carries it
        status["speculation"] = spec_status
        status["prefixCache"] = engine.prefix_cache_status()
        status["kvCache"] = engine.kv_cache_status()
        # what its prompts may hold, and where it takes no images, why
        status["modalities"] = ["text", "image"] if engine.vision is not None else ["text"]
        if engine.vision is None:
            status["imageRefusal"] = engine.image_refusal


def model_status(ctx: ModelContext, obj: StoredObject, state: ModelState) -> dict[str, Any]:
    served, running = state.serving, state.running
    spec = running.spec
    status: dict[str, Any] = {"observedGeneration": obj.generation, "phase": served.phase.value,
                              "conditions": [_ready(obj, state), _degraded(obj, state)]}
    if served.retry_at is not None and served.engine is None:
        status["nextAttemptSeconds"] = max(0, round(served.retry_at - time.monotonic()))
    if running.download is not None and running.download.active:
        status["download"] = running.download.as_dict()
    request = running.request or running.loading_request or (running.spec_request or (None, None))[1]
    if request is not None:
        status["resources"] = {"requests": request.as_dict(), "inUse": model_in_use(state), "node": ctx.node.name}
    status["scaling"] = {"minReplicas": spec.min_replicas, "idleSeconds": spec.idle_seconds,
                         "priority": spec.priority}
    if ctx.cluster is None and spec.replicas > 1:
        status["conditions"].append(condition(
            "Scheduled", False, "Unschedulable", f"{spec.replicas - 1} of {spec.replicas} replicas "
            "fit no Node: this daemon is one Node (start it as a cluster head, docs/cluster.md)",
            obj.generation, obj.status))
    if ctx.cluster is not None and (spec.topology_ref is None or spec.replicas > 1):
        _replicas(obj, state, ctx.node.name, status)
    else:
        status["readyReplicas"] = 1 if served.engine is not None else 0
    status["scaling"]["replicas"] = status["readyReplicas"]  # what runs, as readyReplicas says
    _running(state, status)
    return status


def node_report(ctx: ModelContext, memory: NodeMemory) -> dict[str, Any]:
    """What a worker tells its head in each heartbeat: its memory and the Models it serves."""
    served = {m.name: {"phase": m.serving.phase.value, "ready": m.serving.engine is not None,
                       "generation": m.running.generation,
                       "inFlight": m.serving.engine.in_flight if m.serving.engine is not None else 0,
                       "specPolicy": m.running.policy.name if m.running.policy is not None else None,
                       **({"engine": engine_report(m.serving.engine)} if m.serving.engine is not None else {})}
              for m in ctx.states.values()}
    node = ctx.node
    status = node.status(memory.holdings(), memory.in_use())
    return {"chip": node.chip, "allocatable": node.allocatable, "capacity": node.capacity,
            "status": {**status, "served": served}}
