"""The daemon's control plane: one reconciler per kind, run by one manager, and which
change makes which object be looked at again (controller-runtime's ``Watches``)."""

from __future__ import annotations

from .cluster import Cluster
from .manager import Manager
from .node import Node
from .reconcilers.draft_pairing import DraftPairingReconciler
from .reconcilers.model import ModelReconciler
from .reconcilers.node import NodeReconciler
from .reconcilers.spec_policy import SpecPolicyReconciler
from .reconcilers.topology import TopologyReconciler
from .registry import ModelRegistry
from .store import Store


class ControlPlane:
    def __init__(self, store: Store, registry: ModelRegistry, drain_grace: float = 30.0, node: Node | None = None,
                 cluster: Cluster | None = None, routing: str = "prefix"):
        self.store, self.registry, self.cluster = store, registry, cluster
        self.manager = manager = Manager(store)
        self.models = models = ModelReconciler(store, registry, manager.enqueue, drain_grace, node, cluster, routing)
        pairings = DraftPairingReconciler(store, registry)
        policies = SpecPolicyReconciler(store, registry)
        topologies = TopologyReconciler(store)
        for reconciler in (models, pairings, policies, topologies):
            manager.add(reconciler)
        # a Model takes its pairing, policy and topology: their changes are its changes
        manager.watch("DraftPairing", "Model", lambda name: models.names())
        manager.watch("SpecPolicy", "Model", lambda name: models.names())
        manager.watch("Topology", "Model", topologies.using)
        # pairings and policies report on Models: a Model's change (or its status's) is theirs
        manager.watch("Model", "DraftPairing", pairings.targeting, status=True)
        manager.watch("Model", "SpecPolicy", lambda name: policies.names(), status=True)
        manager.watch("DraftPairing", "DraftPairing", lambda name: pairings.names())  # which one a target takes
        if cluster is not None:
            manager.add(NodeReconciler(store, cluster, registry, models.remote, models.look_at_all))
            cluster.on_heartbeat = lambda name: manager.enqueue("Node", name)

    async def run(self) -> None:
        await self.manager.run()
