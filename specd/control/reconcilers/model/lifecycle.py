"""A Model's engines coming and going: loading a generation, failing with backoff, draining,
unloading, a group's failure and restart, and removal."""

from __future__ import annotations

import asyncio
import time

import structlog

from ....api.manifest import ModelSpec
from ....core.attention import forget_masks
from ....core.memory import heap_tops_returned, return_freed_memory
from ....engine.interface import RankGroup, ServingEngine
from ....serving.registry import Phase
from ...launch import launch
from ...placement import Placement
from ...state import ModelState, Pairing
from .context import ModelContext

log = structlog.get_logger(__name__)


def group_backoff(restarts: int) -> float:
    """Seconds before restarting a group that failed ``restarts`` times in a row: 1, 2, 4 .. 30."""
    return min(30.0, 2.0 ** min(restarts - 1, 5))


def load_backoff(failures: int) -> float:
    """Seconds before loading again a Model whose load failed ``failures`` times in a row
    for a reason that can pass: 10, 20, 40 .. 300 (Kubernetes' image pull backoff)."""
    return min(300.0, 10.0 * 2.0 ** min(failures - 1, 5))


def release_drained() -> None:
    """What a drained engine leaves behind, handed back (off the event loop: it frees MLX arrays):
    its reference cycles, the attention masks remembered for its steps, MLX's cache, the heap's
    free pages, the free tops of the heaps its arrays were in."""
    with heap_tops_returned():
        forget_masks()
        return_freed_memory(cycles=True)


def can_pass(exc: BaseException) -> bool:
    """Whether a load failure may not happen again: the network or the hub (offline,
    unreachable, rate limited), a file that may yet appear, memory that ran out.
    A bad configuration or an unsupported family stays failed until the spec changes."""
    if isinstance(exc, (OSError, MemoryError, TimeoutError)):  # requests' and the hub's errors are OSErrors
        return True
    text = str(exc).lower()
    return "out of memory" in text or "malloc" in text


class Lifecycle:
    def __init__(self, ctx: ModelContext):
        self.ctx = ctx
        self.drains: dict[str, asyncio.Task] = {}  # unloads in progress, by Model

    async def load(self, state: ModelState, generation: int, spec: ModelSpec, pairing: Pairing | None,
                   placed: Placement, group_key: tuple | None, drains: list[asyncio.Task]) -> None:
        """Load a generation of a model; on success switch traffic to it and drain the old engine.

        A local model's memory is reserved already (``NodeMemory.place``); it loads once the Models
        unloaded to make room have drained. A tensor-parallel model is meant to be too big
        for two copies: its old group drains before the new one starts."""
        ctx, served, running = self.ctx, state.serving, state.running
        request = running.loading_request
        started = time.monotonic()
        try:
            await asyncio.gather(*drains)
            log.info("model loading", model=state.name, source=spec.source, generation=generation)
            ctx.event(state.name, "Normal", "Loading", f"loading {spec.source}")
            if placed.topology is not None and served.engine is not None:
                old, served.engine, served.phase = served.engine, None, Phase.LOADING
                ctx.metrics.model_ready.labels(state.name).set(0)
                await self.drain(state.name, old)
            built = await launch(state.name, spec, pairing, placed, ctx.metrics, lambda: ctx.look(state.name),
                                 ctx.prefix_disk_root)
        except asyncio.CancelledError:  # a newer generation replaces this load (and may have reserved already)
            if running.loading_request is request:
                state.loading(None)
            raise
        except Exception as exc:
            self.failed(state, generation, spec, exc, group_key)
            return
        built.engine.start()
        running.request, running.failures = request, 0
        state.loading(None)
        ctx.metrics.model_load_seconds.labels(state.name).observe(time.monotonic() - started)
        if request is not None:
            ctx.metrics.model_memory_request.labels(state.name).set(request.total)
        old = served.engine
        served.engine, running.spec, running.generation = built.engine, spec, generation
        served.phase, served.reason, running.loading_generation = Phase.READY, "", None
        running.group_key, served.retry_at, running.faults_seen = group_key, None, 0
        running.load_seconds, running.weight_bytes = time.monotonic() - started, built.weight_bytes
        running.pairing = pairing if spec.task == "generate" else None
        running.pairing_error, running.policy = built.pairing_error, None
        if built.pairing_error:
            ctx.store.record_event("DraftPairing", pairing.name, "Warning", "DraftLoadFailed", built.pairing_error)
        ctx.metrics.model_ready.labels(state.name).set(1)
        ctx.metrics.model_loaded(state.name, built.weight_bytes)
        log.info("model ready", model=state.name, generation=generation, seconds=round(running.load_seconds, 2))
        ctx.event(state.name, "Normal", "Ready",
                  f"serving generation {generation} ({running.load_seconds:.2f}s to load)")
        if old is not None:
            ctx.spawn(self.drain(state.name, old), state.name)

    def failed(self, state: ModelState, generation: int, spec: ModelSpec, exc: Exception,
               group_key: tuple | None = None) -> None:
        """A load (or the read of its memory request) failed: retried with backoff if it can
        pass, else Failed until the spec changes or a rollout restart."""
        served, running = state.serving, state.running
        reason = f"{type(exc).__name__}: {exc}"
        log.error("model failed to load", model=state.name, reason=reason)
        running.loading_generation, running.generation, running.restart = None, generation, False
        running.group_key = group_key
        state.loading(None)
        if group_key is not None:  # a group start can fail for passing reasons (a host rebooting)
            running.restarts += 1
            served.retry_at = time.monotonic() + group_backoff(running.restarts)
        elif can_pass(exc):
            running.failures += 1
            delay = load_backoff(running.failures)
            served.retry_at = time.monotonic() + delay
            reason += f" (attempt {running.failures}; next in {delay:.0f}s)"
        else:
            served.retry_at = None
        self.ctx.event(state.name, "Warning", "BackOff" if served.retry_at and group_key is None else "LoadFailed",
                       reason)
        if served.engine is None:
            served.phase, running.spec = Phase.FAILED, spec
        served.reason = reason

    async def drain(self, name: str, engine: ServingEngine) -> None:
        await engine.shutdown(self.ctx.drain_grace)
        log.info("engine drained", model=name)
        del engine  # the last reference: the weights and caches are collected, then handed back
        await asyncio.to_thread(release_drained)
        if self.drains.get(name) is asyncio.current_task():
            del self.drains[name]
        self.ctx.look_at_all()  # the memory it held may place another Model

    def unload(self, state: ModelState, reason: str, message: str) -> None:
        """Stop routing to the Model's engine and give its memory back once it drained."""
        ctx, served, running = self.ctx, state.serving, state.running
        engine, served.engine, running.request = served.engine, None, None
        served.phase, served.reason = Phase.IDLE, message
        running.pairing, running.policy = None, None
        ctx.metrics.model_ready.labels(state.name).set(0)
        ctx.metrics.model_unloads.labels(state.name, reason.lower()).inc()
        log.info("model unloaded", model=state.name, reason=reason)
        ctx.event(state.name, "Normal", reason, message)
        self.drains[state.name] = ctx.spawn(self.drain(state.name, engine), state.name)
        ctx.look(state.name)

    @staticmethod
    def waits_after_failure(state: ModelState, generation: int, now: float) -> bool:
        """Whether the Model's load (or the read of its memory request) failed at ``generation``
        and waits: for its backoff, or for a new spec or a rollout restart where it cannot pass."""
        served, running = state.serving, state.running
        return (served.phase is Phase.FAILED and running.generation == generation and not running.restart
                and (served.retry_at is None or now < served.retry_at))

    def idle(self, state: ModelState, now: float) -> bool:
        """Whether a Model at ``minReplicas: 0`` has gone unused for its ``idleSeconds``."""
        served, spec = state.serving, state.running.spec
        return (served.engine is not None and spec.min_replicas == 0 and not served.demand
                and state.running.loading_generation is None and served.engine.in_flight == 0
                and now - served.last_used >= spec.idle_seconds)

    def check_group(self, state: ModelState) -> None:
        """A failed tensor-parallel group: stop routing to it and schedule a restart (with backoff)."""
        served, running = state.serving, state.running
        group = served.engine
        if group is None or not group.failure:
            return
        served.engine, running.restarts, running.last_failure = None, running.restarts + 1, group.failure
        running.request = None  # its ranks are killed: the memory is free until the restart places it again
        served.phase, served.reason = Phase.FAILED, group.failure
        served.retry_at = time.monotonic() + group_backoff(running.restarts)
        self.ctx.metrics.model_ready.labels(state.name).set(0)
        self.ctx.event(state.name, "Warning", "GroupFailed", group.failure)
        self.ctx.spawn(group.shutdown(0), state.name)

    def lost_ranks(self, state: ModelState) -> None:
        """A running group with a rank on a Node that is NotReady has lost that rank (the Mac is gone
        or cut off): it fails now, and its restart places the rank on a host that is Ready."""
        cluster = self.ctx.cluster
        if not isinstance(state.serving.engine, RankGroup) or cluster is None:
            return
        lost = [n for n in state.placed.group_memory if (m := cluster.members.get(n)) is not None and not m.ready]
        if lost:
            state.serving.engine.fail(f"Node {', '.join(lost)} is NotReady: its rank is lost")

    def note_faults(self, state: ModelState) -> None:
        """An event for every engine fault since the last look (the engine recovers by itself)."""
        engine, running = state.serving.engine, state.running
        if engine.faults > running.faults_seen:
            self.ctx.event(state.name, "Warning", "EngineFault",
                           f"{engine.faults - running.faults_seen} failed step(s); last: {engine.fault}")
            running.faults_seen = engine.faults

    def remove(self, name: str) -> None:
        """The Model was deleted: stop routing to it, let in-flight requests finish."""
        ctx = self.ctx
        state = ctx.states.pop(name)
        ctx.registry.models.pop(name, None)
        if state.running.task is not None:
            state.running.task.cancel()
        ctx.metrics.forget_model(name)
        if state.serving.engine is not None:
            ctx.spawn(self.drain(name, state.serving.engine), name)
        if state.serving.replica_set is not None:
            ctx.spawn(state.serving.replica_set.shutdown(ctx.drain_grace), name)
        if ctx.cluster is not None:
            ctx.cluster.reserve(name, {})  # its group's ranks elsewhere
            ctx.cluster.unplace(name)
            for member in ctx.cluster.ready():  # its replicas there are deleted
                ctx.enqueue("Node", member.name)
        log.info("model removed", model=name)
