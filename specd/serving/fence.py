"""Fencing a worker's replicas by the head's placement epoch, so one replica never serves twice.

A head numbers each Model's placement: the epoch moves whenever the set of Nodes its replicas are
placed on changes (kept in the Model's status, so a restarted head goes on counting). The head
applies a replica to a worker with the epoch it was placed at (``EPOCH_ANNOTATION``), sends the
Model's current epoch with every call to the worker's replica API (``EPOCH_HEADER``), and answers
each heartbeat with every Model's epoch and the Models it places on that Node.

A worker cut off from its head for longer than the head waits before it may move the worker's
replicas elsewhere serves its head-placed replicas no call under the epoch it knows (409
``StalePlacement``), so a partition never leaves two replicas serving one placement. Once it hears
from the head again, a replica the head moved keeps refusing every call until the head deletes
it, and any call sent under an epoch older than the latest the worker knows is refused. The head's own routing leaves a Node out once its placement
moves (``Replicas.nodes``); the fence is what keeps anything holding the old placement, a stale
client or a head restored from an older store, from being served by the old copy.
"""

from __future__ import annotations

import time
from typing import Any, Callable

EPOCH_HEADER = "X-Specd-Placement-Epoch"
EPOCH_ANNOTATION = "specd.dev/placement-epoch"


def applied_epoch(annotations: dict[str, str]) -> int | None:
    """The epoch a head placed a worker's Model at (None: no head placed it)."""
    value = annotations.get(EPOCH_ANNOTATION)
    return None if value is None else int(value)


def sent_epoch(header: str | None) -> int | None:
    try:
        return None if header is None else int(header)
    except ValueError:
        return None


class PlacementFence:
    """On a worker: the head's latest word on each Model's placement epoch and where it places them,
    and when it came. A worker that has not heard from its head for a lease (as long as the head
    waits before it counts the Node NotReady and may move its replicas) cannot know its replicas
    are still placed here: it serves a head's call only under an epoch newer than any it knows
    (the head moved on, and still places the Model here, since it calls)."""

    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds, self._clock = lease_seconds, clock
        self.epochs: dict[str, int] = {}  # every Model's current placement epoch, as the head last said
        self.placed: set[str] = set()  # the Models the head places on this Node
        self._heard_at: float | None = None

    def heard(self, placements: dict[str, Any]) -> None:
        """A heartbeat answer's ``placements``: ``{"epochs": {model: epoch}, "placed": [model, ...]}``."""
        self.epochs = {str(m): int(e) for m, e in placements.get("epochs", {}).items()}
        self.placed = {str(m) for m in placements.get("placed", [])}
        self._heard_at = self._clock()

    def refusal(self, model: str, applied: int | None, sent: int | None) -> str | None:
        """Why the head's call for ``model``, sent under epoch ``sent``, must not run on the replica
        applied here at epoch ``applied`` (None: it may run)."""
        if applied is None:
            return None  # a Model no head placed here
        latest = self.epochs.get(model)
        if latest is not None and latest >= applied and model not in self.placed:
            return (f'the head placed "{model}" on other Nodes at placement epoch {latest}; this replica, placed '
                    f"at epoch {applied}, is fenced until the head removes it")
        known = max(applied, latest or 0)
        if sent is None or sent < known:
            return (f'the call for "{model}" was sent under placement epoch {sent}, older than {known}: '
                    "a stale placement")
        silent = None if self._heard_at is None else self._clock() - self._heard_at
        if sent == known and (silent is None or silent > self.lease_seconds):
            since = "since it started" if silent is None else f"for {silent:.0f}s"
            return (f'this Node has not heard from its head {since}: its replica of "{model}" (placement epoch '
                    f"{known}) may have moved, so it serves only a call under a newer epoch until the head answers")
        return None
