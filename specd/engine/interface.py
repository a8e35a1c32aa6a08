"""What serves a Model, as the control plane and the HTTP routes see it.

A local ``Engine`` (one process), a tensor- or pipeline-parallel group's client
(``parallel.group.GroupClient``, whose engine runs in rank processes), a replica
on another Node (``serving.remote.RemoteEngine``) and, on a cluster head, a Model's
replicas together (``serving.replica_set.ReplicaSet``) all implement
``ServingEngine``; the registry, the reconcilers and the server use nothing else. Only a
local engine changes its drafter while it serves (``SwappableDrafter``); a group is restarted
with its new DraftPairing, and fails whole when a host of its ranks is lost (``RankGroup``).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Protocol, runtime_checkable

import mlx.nn as nn

from ..core.request import GenerationRequest, StepOutput
from ..core.request import Method, SpeculationConfig
from ..core.vision import VisionTower
from ..speculation.config import PolicySettings

DRAIN_POLL_S = 0.05  # how often a draining engine looks whether its requests are done
# A longer gap between those looks is a pause of the whole process (a worker stopped, a stalled VM),
# not time its requests had to finish: it counts as this much of the grace
DRAIN_PAUSE_S = 0.5


async def drain_within(busy: Callable[[], bool], grace: float) -> None:
    """Wait while ``busy()``, for at most ``grace`` seconds of the process running: ``shutdown``'s
    grace, as every ServingEngine counts it. A worker stopped for 30 s in the middle of a drain
    (SIGSTOP) resumed with its grace spent by the clock, and failed requests it could have finished."""
    left, last = grace, time.monotonic()
    while busy() and left > 0:
        await asyncio.sleep(DRAIN_POLL_S)
        now = time.monotonic()
        left, last = left - min(now - last, DRAIN_PAUSE_S), now


class ServingEngine(Protocol):
    name: str
    tokenizer: object  # mlx-lm's TokenizerWrapper: the HTTP layer renders and tokenizes with it
    failure: str | None  # set when the engine can no longer serve (a group lost a rank)
    fault: str | None  # the last step's error while no later step has succeeded (the Model is Degraded)
    faults: int  # steps that failed so far
    vision: VisionTower | None  # what a prompt's images are prepared with (None: the Model takes none)
    image_refusal: str  # why it takes no images, when ``vision`` is None

    @property
    def max_context(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def speculation(self) -> SpeculationConfig:
        """The model's default speculation (its DraftPairing's)."""

    @property
    def drafter(self) -> Method | None:
        """The attached drafter's method (a draft model or an EAGLE head), if any."""

    @property
    def in_flight(self) -> int: ...

    def start(self) -> None: ...

    def check_prompt(self, request: GenerationRequest) -> None:
        """Raise RequestRejected if the request can never be served as asked."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        """Serve one request: its outputs until the last (cancelled if the consumer stops)."""

    async def shutdown(self, grace: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish within ``grace``, then stop."""

    def set_policy(self, policy: PolicySettings | None, name: str | None) -> None: ...

    def speculation_status(self) -> dict: ...

    def prefix_cache_status(self) -> dict:
        """The prefix cache's budget, bytes held and hit rate (read from any thread)."""

    def kv_cache_status(self) -> dict:
        """The KV budget, bytes the running rows hold, and preemptions (read from any thread)."""

    def group_status(self) -> dict | None:
        """A tensor-parallel group's ranks and progress (None for a local engine)."""

    def exported_metrics(self) -> str | None:
        """Prometheus text of series kept outside the daemon's registry (a group's rank 0)."""


@runtime_checkable
class SwappableDrafter(Protocol):
    """An engine whose DraftPairing is attached, changed or detached while it serves."""

    @property
    def drafter_module(self) -> nn.Module | None:
        """The attached draft model or EAGLE head, to keep when only a pairing's settings change."""

    def load_drafter(self, method: Method, source: str, pairing: str) -> nn.Module:
        """Load (blocking) a pairing's drafter, checked against this target."""

    def configure_speculation(self, default: SpeculationConfig, drafter: nn.Module | None) -> None:
        """Attach, change or detach the pairing between steps."""


@runtime_checkable
class RankGroup(Protocol):
    """An engine whose ranks run on several hosts: losing one host's rank fails the whole group."""

    def fail(self, reason: str) -> None:
        """End every request with the reason and stop the ranks (``failure`` says why from then on)."""
