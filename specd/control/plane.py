"""The daemon's control plane: one reconciler per kind, run by one manager, and which
change makes which object be looked at again (controller-runtime's ``Watches``)."""

from __future__ import annotations

from typing import Any

from ..api.manifest import API_VERSION
from ..serving.cluster import Cluster
from ..serving.registry import ModelRegistry
from ..store import Store, now_iso
from .manager import Manager
from .node import Node
from .reconcilers.draft_pairing import DraftPairingReconciler
from .reconcilers.model import ModelReconciler
from .reconcilers.node import NodeReconciler
from .reconcilers.spec_policy import SpecPolicyReconciler
from .reconcilers.topology import TopologyReconciler

STARTED_AT = now_iso()


class ControlPlane:
    def __init__(self, store: Store, registry: ModelRegistry, drain_grace: float = 30.0, node: Node | None = None,
                 cluster: Cluster | None = None, routing: str = "prefix"):
        self.store, self.registry, self.cluster = store, registry, cluster
        self.manager = manager = Manager(store)
        self.models = models = ModelReconciler(store, registry, manager.enqueue, drain_grace, node, cluster, routing)
        pairings = DraftPairingReconciler(store, models.states)
        policies = SpecPolicyReconciler(store, models.states)
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
            manager.add(NodeReconciler(store, cluster, models.states, models.replicas.remote, models.look_at_all))
            cluster.on_heartbeat = lambda name: manager.enqueue("Node", name)

    async def run(self) -> None:
        await self.manager.run()

    async def shutdown(self, grace: float) -> None:
        """Stop the Models' slow work, drain their engines (``grace`` seconds), close the store."""
        for state in self.models.states.values():
            if state.running.task is not None:
                state.running.task.cancel()
        await self.registry.shutdown(grace)
        self.store.close()

    # what the admin API asks of it (``server.keys.ControlView``)
    @property
    def node_name(self) -> str:
        return self.models.node.name

    @property
    def allocatable(self) -> int:
        return self.models.node.allocatable

    def restart(self, model: str) -> None:
        self.models.restart(model)

    def largest_node(self) -> tuple[int, str]:
        """This node or, on a head, the largest that joined: read without the Nodes' full status,
        as every apply asks it."""
        here = (self.models.node.allocatable, self.models.node.name)
        members = self.cluster.members.values() if self.cluster is not None else ()
        return max([here, *((m.allocatable, m.name) for m in members)])

    def nodes(self) -> list[dict[str, Any]]:
        """This daemon's node and, on a head, the Nodes that joined it, as ``get nodes`` shows them."""
        models, cluster = self.models, self.cluster
        status = models.node.status(models.holdings(), models.in_use())
        name = status.pop("name")
        status["conditions"] = [{"type": "Ready", "status": "True", "reason": "DaemonRunning",
                                 "message": "this daemon serves the node", "lastTransitionTime": STARTED_AT}]
        out = [{"apiVersion": API_VERSION, "kind": "Node", "metadata": {"name": name, "creationTimestamp": STARTED_AT},
                "spec": {"role": "head" if cluster else "standalone"}, "status": status}]
        if cluster is not None:
            stored = {o.name: o for o in self.store.list("Node")}
            for member in cluster.members.values():
                # a NotReady Node's last report may no longer hold: its Models and memory are not shown
                hidden = ("name", "served") if member.ready else ("name", "served", "models", "requested", "inUse", "free", "mlxActive")
                reported = {k: v for k, v in member.status.items() if k not in hidden}
                obj = stored.get(member.name)
                out.append({"apiVersion": API_VERSION, "kind": "Node",
                            "metadata": {"name": member.name, "creationTimestamp": obj.created if obj else None},
                            "spec": {"role": "worker", "address": member.address},
                            "status": {**reported, "chip": member.chip, "allocatable": member.allocatable,
                                       "conditions": [cluster.condition(member)]}})
        return out
