"""A local engine: one model served by its own thread.

``generate`` and the other public methods are called from the event loop;
they only touch the ``Inbox``: a request arrives there as it came, and the
engine's thread makes it a ``Sequence`` (its RNG key, its grammar's matcher)
when it takes it. All MLX work happens on the engine's thread, which takes
what arrived and runs one scheduler step at a time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

import mlx.nn as nn
import structlog

from ..core.loader import load_draft_model
from ..core.request import GenerationRequest, StepOutput
from ..core.sequence import Sequence
from ..core.vision import VisionTower
from ..metrics import Metrics
from ..core.request import Method, NO_SPECULATION, SpeculationConfig
from ..speculation.config import PolicySettings
from ..speculation.dflash.checkpoint import load_dflash
from ..speculation.eagle.checkpoint import load_head
from ..speculation.mtp.checkpoint import load_mtp_head
from . import threads
from .interface import drain_within
from .scheduler import EngineConfig, Scheduler, StepInputs, check_request

log = structlog.get_logger(__name__)


def load_drafter(method: Method, source: str, pairing: str, target: nn.Module, tokenizer) -> nn.Module:
    """Load (blocking) a pairing's draft model, EAGLE head, MTP head (``source``: the
    target's own checkpoint) or DFlash drafter, checked against the target."""
    if method == Method.EAGLE:
        return load_head(source, target)
    if method == Method.MTP:
        return load_mtp_head(source, target)
    if method == Method.DFLASH:
        return load_dflash(source, target)
    return load_draft_model(source, target, tokenizer, pairing)


class EngineOverloaded(Exception):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineUnavailable(Exception):
    """The engine is draining or stopped (HTTP 503)."""


# An idle engine's first arrival waits for companions until none comes for SETTLE_S (at most SETTLE_MAX_S)
SETTLE_S = 0.001
SETTLE_MAX_S = 0.005


class Inbox:
    """What the event loop hands the engine thread: arrivals, cancellations,
    updates to run between steps, and stop. An arrival becomes a ``Sequence``
    (``admit``) on the thread that takes it, never on the event loop."""

    def __init__(self, admit: Callable[[GenerationRequest, Callable[[StepOutput], None]], Sequence]) -> None:
        self._admit = admit
        self._cv = threading.Condition()
        self._arrivals: deque[tuple[GenerationRequest, Callable[[StepOutput], None]]] = deque()
        self._cancelled: set[str] = set()
        self._updates: list[Callable[[], None]] = []
        self.accepting = True
        self.stopped = False

    def __len__(self) -> int:
        return len(self._arrivals)

    def submit(self, request: GenerationRequest, emit: Callable[[StepOutput], None],
               room: Callable[[int], None]) -> None:
        """Queue ``request``; ``room(queued)`` raises when no more may wait."""
        with self._cv:
            if not self.accepting:
                raise EngineUnavailable("shutting down")
            room(len(self._arrivals))
            self._arrivals.append((request, emit))
            self._cv.notify()

    def cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancelled.add(request_id)
            self._cv.notify()

    def between_steps(self, update: Callable[[], None]) -> None:
        with self._cv:
            self._updates.append(update)
            self._cv.notify()

    def close(self) -> None:
        """Take no more requests."""
        with self._cv:
            self.accepting = False

    def stop(self) -> None:
        with self._cv:
            self.accepting = False
            self.stopped = True
            self._cv.notify()

    def take(self, busy: bool) -> StepInputs | None:
        """Wait for work unless ``busy``; take what arrived since the last step (None: stop).
        An idle engine woken by an arrival first lets the requests that came with it arrive too
        (until none has for ``SETTLE_S``, at most ``SETTLE_MAX_S``), so clients that start
        together are prefilled as one group rather than one step after another."""
        with self._cv:
            while not (busy or self._arrivals or self._cancelled or self._updates or self.stopped):
                self._cv.wait()
            if not busy and self._arrivals:
                deadline = time.monotonic() + SETTLE_MAX_S
                while not self.stopped and (left := deadline - time.monotonic()) > 0:
                    waiting = len(self._arrivals)
                    self._cv.wait(min(SETTLE_S, left))
                    if len(self._arrivals) == waiting:
                        break
            if self.stopped:
                return None
            arrivals = list(self._arrivals)
            cancelled, updates = self._cancelled, self._updates
            self._arrivals.clear()
            self._cancelled, self._updates = set(), []
        return StepInputs(self._sequences(arrivals), cancelled, updates)

    def drain(self) -> list[Sequence]:
        """Arrivals that will never be stepped (the engine stopped)."""
        with self._cv:
            arrivals = list(self._arrivals)
            self._arrivals.clear()
        return self._sequences(arrivals)

    def _sequences(self, arrivals: list[tuple[GenerationRequest, Callable[[StepOutput], None]]]) -> list[Sequence]:
        """The arrivals as sequences; one that cannot be made (its grammar does not compile) ends
        with the reason."""
        seqs = []
        for request, emit in arrivals:
            try:
                seqs.append(self._admit(request, emit))
            except Exception as exc:
                log.warning("request could not start", request_id=request.request_id, error=str(exc))
                emit(StepOutput(text="", tokens=[], logprobs=None, error=f"{type(exc).__name__}: {exc}",
                                prompt_tokens=len(request.prompt_tokens), completion_tokens=0))
        return seqs


class Engine:
    """Serves one model in this process (implements ``ServingEngine``)."""

    failure: str | None = None  # a local engine fails requests, not itself

    def __init__(self, name: str, model: nn.Module, tokenizer, config: EngineConfig = EngineConfig(),
                 metrics: Metrics | None = None, speculation: SpeculationConfig = NO_SPECULATION,
                 drafter: nn.Module | None = None, on_fault: Callable[[], None] | None = None,
                 vision: VisionTower | None = None, image_refusal: str = "its checkpoint has no vision tower"):
        self.name = name
        self.vision = vision
        self.image_refusal = image_refusal  # why it takes no images, when it has no vision tower
        self.fault: str | None = None  # the last step's fault, until a later step succeeds
        self.faults = 0
        self._on_fault = on_fault
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or Metrics()
        self.scheduler = Scheduler(name, model, tokenizer, config, self.metrics, speculation, drafter, vision)
        self.inbox = Inbox(self.scheduler.sequence)
        self.scheduler.wake = lambda: self.inbox.between_steps(lambda: None)
        self._stepped: threading.Event | None = None  # set once its loop has returned (``threads.run``)

    # -- ServingEngine ---------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.scheduler.max_context

    @property
    def vocab_size(self) -> int:
        return self.scheduler.vocab_size

    @property
    def speculation(self) -> SpeculationConfig:
        """The model's default speculation (its DraftPairing's)."""
        return self.scheduler.speculator.default

    @property
    def drafter(self) -> Method | None:
        """The method of the pairing's drafter, if one is attached."""
        return self.scheduler.speculator.drafter_method

    @property
    def drafter_module(self) -> nn.Module | None:
        return self.scheduler.speculator.drafter_module

    @property
    def in_flight(self) -> int:
        return len(self.inbox) + self.scheduler.in_flight

    def start(self) -> None:
        self._stepped = threads.run(self._run, f"engine-{self.name}")

    def check_prompt(self, request: GenerationRequest) -> None:
        """Raise RequestRejected if the request can never be served as asked."""
        check_request(request, self.name, self.drafter, self.max_context, self.vocab_size,
                      self.scheduler.context_reason)

    def speculation_status(self) -> dict:
        """What ``describe`` shows of the model's speculation (read from any thread)."""
        return self.scheduler.speculator.status()

    def prefix_cache_status(self) -> dict:
        return self.scheduler.prefix_status()

    def kv_cache_status(self) -> dict:
        return self.scheduler.kv.status()

    def group_status(self) -> dict | None:
        return None

    def exported_metrics(self) -> str | None:
        """The engine's series are in the daemon's own registry."""
        return None

    def load_drafter(self, method: Method, source: str, pairing: str) -> nn.Module:
        return load_drafter(method, source, pairing, self.model, self.tokenizer)

    def configure_speculation(self, default: SpeculationConfig, drafter: nn.Module | None) -> None:
        self.inbox.between_steps(lambda: self.scheduler.configure_speculation(default, drafter))

    def set_policy(self, policy: PolicySettings | None, name: str | None) -> None:
        """Swap in the SpecPolicy's controller (None: speculate as requests ask)."""
        self.inbox.between_steps(lambda: self.scheduler.speculator.feedback.set_policy(policy, name))

    def submit(self, request: GenerationRequest, emit: Callable[[StepOutput], None]) -> None:
        """Queue a request; ``emit(StepOutput)`` is called from the engine thread. One the route
        checked already is trusted; any other caller's is checked here."""
        if not request.checked:
            self.check_prompt(request)
        try:
            self.inbox.submit(request, emit, self._room)
        except EngineUnavailable:
            raise EngineUnavailable(f"model {self.name!r} is shutting down") from None

    def _room(self, queued: int) -> None:
        if queued + len(self.scheduler.waiting) >= self.config.max_waiting:
            self.metrics.request_failure.labels(self.name, "overloaded").inc()
            raise EngineOverloaded(
                f"model {self.name!r} has {self.config.max_waiting} requests waiting; retry later")

    def cancel(self, request_id: str) -> None:
        """Free a request's batch slot at the next step boundary."""
        self.inbox.cancel(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its outputs; cancels it if the consumer stops early."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.submit(request, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None or out.error is not None
                yield out
        finally:
            if not finished:
                self.cancel(request.request_id)

    async def shutdown(self, grace: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish within ``grace`` (``drain_within``), then stop."""
        self.inbox.close()
        await drain_within(lambda: self.in_flight > 0, grace)
        self.stop()
        if self._stepped is not None:
            await asyncio.to_thread(self._stepped.wait, 10.0)

    def stop(self) -> None:
        """Stop now: the engine thread leaves after its current step, failing what is left."""
        self.inbox.stop()

    # -- engine thread ---------------------------------------------------

    def _notify(self) -> None:
        if self._on_fault is not None:
            self._on_fault()

    def _run(self) -> None:
        scheduler = self.scheduler
        while (inputs := self.inbox.take(scheduler.busy)) is not None:
            try:
                scheduler.step(inputs)
            except Exception as exc:  # an engine fault fails its requests, not the daemon
                log.exception("engine step failed", model=self.name)
                self.fault, self.faults = f"{type(exc).__name__}: {exc}", self.faults + 1
                self.metrics.engine_faults.labels(self.name).inc()
                scheduler.fail_all(f"engine error: {self.fault}", self.inbox.drain())
                self._notify()
            else:
                if self.fault is not None:  # recovered: the failed step's state went with its requests
                    self.fault = None
                    self._notify()
        scheduler.fail_all("engine stopped", self.inbox.drain())
        scheduler.close()
