"""A Model served by a group of ranks (``spec.topologyRef``): where its ranks run, what they
hold on each Node, and on a head its further replicas as groups with rank 0 on a worker."""

from __future__ import annotations

from dataclasses import replace

from ....engine.resources import MemoryRequest, rank_request
from ....parallel.topology import is_local
from ....serving.cluster import rank_holder
from ...placement import Candidate, Placement, place_group, place_remote_groups
from ...state import Desired, ModelState
from .context import ModelContext
from .memory import NodeMemory
from .replicas import ReplicaPlacement


class GroupPlacement:
    def __init__(self, ctx: ModelContext, memory: NodeMemory, replicas: ReplicaPlacement | None):
        self.ctx, self.memory, self.replicas = ctx, memory, replicas  # replicas: on a head only

    def _others(self) -> dict:
        """The cluster's Nodes other than this one (none on a daemon that is no head)."""
        ctx = self.ctx
        members = ctx.cluster.members if ctx.cluster is not None else {}
        return {n: m for n, m in members.items() if n != ctx.node.name}

    def place_remote(self, state: ModelState, want: Desired) -> None:
        """On a head: a group Model's replicas after the group beside the head (``replicas`` > 1)
        are groups whose rank 0 runs on a worker Node of its Topology (``place_remote_groups``).
        The head applies each worker the Model with a Topology of its group's hosts, and the worker
        starts that group as its own; the head reserves what its other ranks hold on Nodes."""
        ctx, placed, obj, spec, topology = self.ctx, state.placed, want.obj, want.spec, want.topology_spec
        current = placed.remote_groups or {r["node"]: r["hosts"] for r in obj.status.get("replicas", [])
                                           if r["node"] != ctx.node.name and r.get("hosts")}
        members = self._others()
        request = self.memory.cached_request(state, spec, want.pairing)
        if spec.replicas > 1 and request is None:  # the look that reads it places them
            placed.remote_groups, placed.replica_nodes = current, [ctx.node.name, *current]  # as stored
            return
        groups, short = {}, ""
        if spec.replicas > 1:
            ranks = topology.tensor_parallel_size
            share = rank_request(request, ranks).total
            pool = [h.name for h in topology.hosts[1:] if h.name not in placed.group_hosts]
            if self.replicas.settling(state, [h for hosts in current.values() for h in hosts]):
                groups = {n: hosts for n, hosts in current.items() if n in members and set(hosts) <= set(pool)}
            else:
                candidates = [Candidate(m.name, ctx.cluster.free_on(m, rank_holder(state.name))
                                        + (share if m.model(state.name) else 0), m.ready) for m in members.values()]
                groups, short = place_remote_groups(pool, spec.replicas - 1, ranks, share, current, candidates)
            placed.remote_group_memory = {h: share for hosts in groups.values() for h in hosts[1:] if h in members}
        else:
            placed.remote_group_memory = {}
        for gone in set(placed.remote_groups) - set(groups):
            self.replicas.router.forget(state.name, gone)
            ctx.enqueue("Node", gone)  # its group is deleted from it
            lost = [h for h in placed.remote_groups[gone] if h in members and not members[h].ready]
            if lost:
                ctx.event(state.name, "Warning", "Rescheduled",
                          f"the group with rank 0 on Node {gone} moved: Node {lost[0]} is NotReady")
        placed.remote_groups, placed.replicas_short = groups, short
        nodes = [ctx.node.name, *groups] if spec.replicas > 1 else []
        epoch = self.replicas.advance_epoch(state, obj, nodes)
        placed.replica_nodes = nodes
        self.reserve_ranks(state)
        if spec.replicas == 1:
            if state.serving.replica_set is not None:  # it had groups elsewhere: only its own serves now
                state.serving.replica_set.replicas.nodes = [ctx.node.name]
            return
        self.replicas.serve_replicas(state, spec, placed.replica_nodes, epoch)
        applied_with = self.replicas.applied_with(want)
        listed = {h["name"]: h for h in want.topology.spec["hosts"]}
        for node, hosts in groups.items():
            self.replicas.remote.ensure(members[node], obj, *applied_with,
                                        {**want.topology.spec, "hosts": [listed[h] for h in hosts]}, epoch=epoch)

    def reserve_ranks(self, state: ModelState) -> None:
        """On a head: reserve on each Node what ranks of the Model's groups that no daemon of that
        Node placed hold there: ranks of the group beside the head, and of its groups elsewhere
        beside their rank 0."""
        held = dict(state.placed.remote_group_memory)
        for node, bytes_ in state.placed.group_reserved.items():
            held[node] = held.get(node, 0) + bytes_
        self.ctx.cluster.reserve(state.name, held)

    def placement(self, state: ModelState, want: Desired, request: MemoryRequest) -> Placement | None:
        """Where a group's ranks run, and its request of this node (the shares of its ranks here).
        Rank 0 runs beside this daemon; the others go to hosts of the Topology (``place_group``):
        its Nodes with room first. ``placed.group_memory`` keeps the bytes on each Node, which the
        head reserves there once this node's part is placed. None: too few hosts have room
        (Unschedulable, with the numbers). A host that is neither this node nor a Node of the
        cluster is not counted."""
        ctx, placed, topology = self.ctx, state.placed, want.topology_spec
        ranks = topology.tensor_parallel_size
        share = rank_request(request, ranks).total
        members = self._others()
        candidates = [Candidate(m.name, ctx.cluster.free_on(m, rank_holder(state.name)), m.ready)
                      for m in members.values()]
        elsewhere = {h for hosts in placed.remote_groups.values() for h in hosts}
        pool = [h.name for h in topology.hosts[1:] if h.name not in elsewhere]
        chosen, short = place_group(pool, ranks - 1, share, candidates)
        if short:
            self.memory.refuse(state, short)
            return None
        by_name = {h.name: h for h in topology.hosts}
        hosts = (topology.hosts[0], *(by_name[name] for name in chosen))
        placed.group_hosts = [h.name for h in hosts]
        here = sum(h.name not in members and (h.name == ctx.node.name or is_local(h.address)) for h in hosts)
        placed.group_memory = {**({ctx.node.name: share * here} if here else {}),
                               **{h.name: share for h in hosts if h.name in members}}
        return Placement(rank_request(request, ranks, here), replace(topology, hosts=hosts))
