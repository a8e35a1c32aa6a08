"""This daemon's node: the memory its Models may take, and what holds it.

Like a Kubernetes node's allocatable memory, it is what the host has less a
reserve for the system: on a Mac, Metal's recommended working set (unified
memory less what macOS keeps), elsewhere physical memory; ``--memory-limit``
lowers it. Every Model that is loaded, or loading, holds its whole memory
request until it is unloaded, so admission never counts on memory a running
Model may still grow into.
"""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass

import mlx.core as mx

from ..core.memory import gib, host_memory_bytes
from ..engine.resources import MemoryRequest

DEFAULT_RESERVE_FRACTION = 0.1  # of the host's memory, kept for the system when --memory-reserve is not given
MIN_RESERVE = 2 << 30


@dataclass
class Holding:
    """What one Model holds on the node: its request, and whether it may make room for another."""

    model: str
    request: MemoryRequest
    loading: bool
    evictable: bool  # minReplicas 0, no request in flight
    priority: int
    last_used: float


class Node:
    def __init__(self, memory_limit: int | None = None, memory_reserve: int | None = None,
                 name: str | None = None):
        self.name = name or socket.gethostname().split(".")[0] or "localhost"
        self.capacity = host_memory_bytes()
        reserve = memory_reserve if memory_reserve is not None else max(
            MIN_RESERVE, int(self.capacity * DEFAULT_RESERVE_FRACTION))
        self.reserve = min(reserve, self.capacity)
        allocatable = self.capacity - self.reserve
        self.allocatable = allocatable if memory_limit is None else min(allocatable, memory_limit)
        self.chip = _chip()

    def requested(self, holdings: list[Holding]) -> int:
        return sum(h.request.total for h in holdings)

    def free(self, holdings: list[Holding]) -> int:
        return self.allocatable - self.requested(holdings)

    def make_room(self, need: int, holdings: list[Holding]) -> list[Holding] | None:
        """The idle Models to unload so that ``need`` bytes fit (lowest priority first,
        least recently used among equals), ``[]`` if they fit already, None if they cannot."""
        free = self.free(holdings)
        if need <= free:
            return []
        victims = []
        for h in sorted((h for h in holdings if h.evictable and not h.loading),
                        key=lambda h: (h.priority, h.last_used)):
            victims.append(h)
            free += h.request.total
            if need <= free:
                return victims
        return None

    def unschedulable(self, model: str, need: int, holdings: list[Holding]) -> str:
        """Why ``model`` cannot be placed, with the numbers."""
        idle = [h.model for h in holdings if h.evictable and not h.loading]
        if need > self.allocatable:
            return (f"needs {gib(need)}; the node {self.name} has {gib(self.allocatable)} allocatable "
                    f"in all: it can never fit here")
        free = self.free(holdings)
        busy = ", ".join(f"{h.model} ({gib(h.request.total)})" for h in holdings if h.model not in idle)
        return (f"needs {gib(need)}; {gib(free)} free of {gib(self.allocatable)}; idle Models that could make "
                f"room: {', '.join(idle) or 'none'}; held by: {busy or 'nothing'}")

    def status(self, holdings: list[Holding], in_use: dict[str, int]) -> dict:
        """What ``specd get nodes`` and ``describe node`` show."""
        return {"name": self.name, "chip": self.chip, "capacity": self.capacity, "reserve": self.reserve,
                "allocatable": self.allocatable, "requested": self.requested(holdings),
                "free": self.free(holdings), "inUse": sum(in_use.values()), "mlxActive": mx.get_active_memory(),
                "models": [{"name": h.model, "requested": h.request.total, "inUse": in_use.get(h.model),
                            "phase": "Loading" if h.loading else "Loaded", "evictable": h.evictable}
                           for h in sorted(holdings, key=lambda h: h.model)]}


def _chip() -> str:
    if mx.metal.is_available():
        return str(mx.metal.device_info().get("device_name", "Apple silicon"))
    return f"{platform.machine()} CPU"
