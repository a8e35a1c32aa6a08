"""The Topology reconciler: a Topology is validated when applied, so its status says so.
The groups that run on it are their Models' (``reconcilers/model/``)."""

from __future__ import annotations

from ..conditions import condition
from ..manager import Result
from ...store import Store

KIND = "Topology"


class TopologyReconciler:
    kind = KIND

    def __init__(self, store: Store):
        self.store = store

    def names(self) -> list[str]:
        return self.store.names(KIND)

    def using(self, topology: str) -> list[str]:
        """The Models that run a group on ``topology``."""
        return [o.name for o in self.store.list("Model") if o.spec.get("topologyRef") == topology]

    def reconcile(self, name: str) -> Result:
        obj = self.store.find(KIND, name)
        if obj is None:
            return Result()
        self.store.set_status(KIND, name, {
            "observedGeneration": obj.generation,
            "conditions": [condition("Ready", True, "Validated", "hosts and backend are valid",
                                     obj.generation, obj.status)]})
        return Result()
