"""What the parts of the Model reconciler share: the store, the serving registry, this
node, the cluster, every Model's state, and how to look at a Model again."""

from __future__ import annotations

import asyncio
from typing import Callable, Coroutine

from ....serving.cluster import Cluster
from ....serving.registry import ModelRegistry
from ....store import Store
from ...node import Node
from ...state import ModelState

KIND = "Model"


class ModelContext:
    def __init__(self, store: Store, registry: ModelRegistry, enqueue: Callable[[str, str], None],
                 node: Node, cluster: Cluster | None, drain_grace: float):
        self.store, self.registry, self.metrics = store, registry, registry.metrics
        self.enqueue = enqueue  # the manager's: look at an object of any kind soon
        self.node, self.cluster = node, cluster  # cluster: this daemon is a head, Nodes join it
        self.drain_grace = drain_grace
        self.prefix_disk_root = store.directory / "prefix-cache"  # where disk tiers go unless a spec says
        self.states: dict[str, ModelState] = {}
        self._background: set[asyncio.Task] = set()

    def look(self, name: str) -> None:
        """Look at the Model soon (callable from any thread: an engine's fault, a request's demand)."""
        self.enqueue(KIND, name)

    def names(self) -> set[str]:
        """Every Model stored, and every one still running after its deletion."""
        return set(self.store.names(KIND)) | set(self.states)

    def look_at_all(self) -> None:
        """Memory was freed, or the cluster changed: every Model may place differently now."""
        for name in self.names():
            self.look(name)

    def spawn(self, coro: Coroutine, model: str) -> asyncio.Task:
        """Run slow work for a Model; its end looks at the Model again."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda _: self.look(model))
        return task

    def event(self, name: str, type_: str, reason: str, message: str) -> None:
        self.store.record_event(KIND, name, type_, reason, message)
