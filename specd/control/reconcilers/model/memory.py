"""This node's memory and each Model's request of it: what every Model holds, its spec's
request (read from its checkpoint, downloading it first), and a load's place, evicting
idle Models to make room or saying why it cannot fit (``Unschedulable``)."""

from __future__ import annotations

import asyncio

from ....api.manifest import ModelSpec
from ....core.download import DownloadProgress
from ....core.request import Method
from ....engine.resources import MemoryRequest, memory_request
from ....serving.registry import Phase
from ...node import Holding
from ...state import ModelState, Pairing
from .context import ModelContext
from .lifecycle import Lifecycle

DOWNLOAD_STATUS_SECONDS = 1.0  # how often a downloading Model's status and metrics follow its progress


def _request_key(spec: ModelSpec, pairing: Pairing | None, allocatable: int) -> tuple:
    """What a memory request is computed from: the spec, the drafter it loads, the node's size."""
    drafter = pairing.spec.source if pairing is not None and pairing.method != Method.NGRAM else None
    return spec, drafter, allocatable


def model_in_use(state: ModelState) -> int | None:
    """What a loaded Model really holds: weights, the KV its rows hold, its prefix cache, its drafter."""
    engine, running = state.serving.engine, state.running
    if engine is None or running.request is None:
        return None
    used = running.weight_bytes or 0
    if running.spec.task == "generate":
        used += engine.kv_cache_status().get("bytes", 0) + engine.prefix_cache_status().get("bytes", 0)
        drafts = running.pairing is not None and running.pairing.method != Method.NGRAM
        used += running.request.drafter if drafts else 0
    return used


class NodeMemory:
    def __init__(self, ctx: ModelContext, lifecycle: Lifecycle):
        self.ctx, self.lifecycle = ctx, lifecycle
        self.head_reserved: dict[str, int] = {}  # on a worker: what the head's groups hold here (their ranks)

    def holdings(self) -> list[Holding]:
        """What every Model holds on the node: a serving engine's request, a loading one's."""
        out = []
        for m in self.ctx.states.values():
            served, running = m.serving, m.running
            prio = running.spec.priority_value
            if running.request is not None:
                evictable = (running.spec.min_replicas == 0 and not served.demand and running.loading_request is None
                             and served.engine is not None and served.engine.in_flight == 0)
                out.append(Holding(m.name, running.request, False, evictable, prio, served.last_used))
            if running.loading_request is not None:
                out.append(Holding(m.name, running.loading_request, True, False, prio, served.last_used))
        for holder, held in self.head_reserved.items():
            out.append(Holding(holder, MemoryRequest(0, 0, 0, 0, 0, override=held), False, False, 0, 0.0))
        return out

    def reserved_by_head(self, reserved: dict[str, int]) -> None:
        """On a worker: the memory the head's groups hold here now, for ranks it started on this Mac."""
        if reserved != self.head_reserved:
            self.head_reserved = dict(reserved)
            self.ctx.look_at_all()  # less room here: a Model waiting for it is told why

    def in_use(self) -> dict[str, int]:
        """What each loaded Model really holds (``model_in_use``)."""
        return {m.name: used for m in self.ctx.states.values() if (used := model_in_use(m)) is not None}

    def cached_request(self, state: ModelState, spec: ModelSpec, pairing: Pairing | None) -> MemoryRequest | None:
        """The spec's memory request, if it was read already (``read_request``)."""
        key = _request_key(spec, pairing, self.ctx.node.allocatable)
        cached = state.running.spec_request
        return cached[1] if cached is not None and cached[0] == key else None

    def start_reading(self, state: ModelState, generation: int, spec: ModelSpec, pairing: Pairing | None) -> None:
        """Read the spec's memory request unless a read (or other slow work) is in flight."""
        if state.running.task is None or state.running.task.done():
            state.running.task = self.ctx.spawn(self.read_request(state, generation, spec, pairing), state.name)

    async def read_request(self, state: ModelState, generation: int, spec: ModelSpec, pairing: Pairing | None) -> None:
        """Read the spec's memory request from its checkpoint, off the loop (the look after places it).
        A hub checkpoint the cache lacks is downloaded first: meanwhile the Model is ``Downloading``,
        with its progress in status and metrics every ``DOWNLOAD_STATUS_SECONDS``."""
        ctx, served = self.ctx, state.serving
        key = _request_key(spec, pairing, ctx.node.allocatable)
        progress = state.running.download = DownloadProgress()
        reading = asyncio.ensure_future(
            asyncio.to_thread(memory_request, spec, key[1], ctx.node.allocatable, False, progress))
        try:
            while not reading.done():
                await asyncio.wait({reading}, timeout=DOWNLOAD_STATUS_SECONDS)
                if progress.active:
                    if served.engine is None:
                        served.phase, served.reason = Phase.DOWNLOADING, progress.message()
                    ctx.metrics.model_download(state.name, progress.done, progress.total)
                    ctx.look(state.name)
            request = reading.result()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.lifecycle.failed(state, generation, spec, exc)
            return
        finally:
            state.running.download = None
            if progress.total:
                ctx.metrics.model_download(state.name, progress.done, progress.total)
        if served.phase is Phase.DOWNLOADING:
            served.phase, served.reason = Phase.PENDING, "reading its memory request"
        state.running.spec_request = (key, request)

    def place(self, state: ModelState, request: MemoryRequest) -> list[asyncio.Task] | None:
        """Reserve the node's memory for a load: beside what the Model serves now if that fits,
        else in place of it (the old engine drains first); idle Models are unloaded to make
        room if they must be. Returns the unloads to wait for, or None (Unschedulable, with
        the numbers in status) if it cannot fit now."""
        node, lifecycle = self.ctx.node, self.lifecycle
        holdings = self.holdings()
        others = [h for h in holdings if h.model != state.name]
        old = [h for h in holdings if h.model == state.name and not h.loading]
        victims = node.make_room(request.total, others + old)
        replace = victims is None and bool(old)
        if replace:
            victims = node.make_room(request.total, others)
        if victims is None:
            self.refuse(state, node.unschedulable(state.name, request.total, others + old))
            return None
        state.serving.unschedulable = ""
        state.loading(request)
        for victim in victims:
            lifecycle.unload(self.ctx.states[victim.model], "Evicted",
                             f"unloaded to make room for {state.name} (priority {victim.priority}, idle)")
        if replace:
            lifecycle.unload(state, "Replaced", "unloaded to make room for its new generation")
        names = [v.model for v in victims] + ([state.name] if replace else [])
        return [lifecycle.drains[n] for n in names if n in lifecycle.drains]

    def refuse(self, state: ModelState, message: str) -> None:
        """The Model cannot be placed now: ``Unschedulable``, with the numbers (an event when they change)."""
        served = state.serving
        if message != served.unschedulable:
            self.ctx.event(state.name, "Warning", "Unschedulable", message)
        served.unschedulable = message
        if served.engine is None:
            served.phase, served.reason = Phase.PENDING, message
