"""Which Nodes run a Model's replicas: placed by memory, like pods on nodes.

A replica stays where it runs while its Node is Ready, or while no Ready Node
has room to take it from a NotReady one; missing ones go to the Ready Nodes
with room for the Model's memory request, the most free memory first, never
two on one Node. A tensor- or pipeline-parallel group runs rank 0
beside the head and its other ranks on hosts of its Topology, the Nodes with
room for a rank's share first; a group Model's further replicas are groups
whose rank 0 runs on a worker Node of its Topology.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..api.manifest import TopologySpec
from ..core.memory import gib
from ..engine.resources import MemoryRequest


@dataclass(frozen=True)
class Placement:
    """What this daemon runs of a Model, as placement decided: an engine here (no ``topology``), or
    a group whose rank 0 runs here, on ``topology``'s hosts (rank 0's first, the others as
    ``place_group`` chose them); and what it holds of this node's memory."""

    request: MemoryRequest
    topology: TopologySpec | None = None


@dataclass(frozen=True)
class Candidate:
    node: str
    free: int  # bytes the Node could still give (its own replica of this Model not counted)
    ready: bool


def place(replicas: int, need: int, current: list[str], candidates: list[Candidate]) -> tuple[list[str], str]:
    """The Nodes for ``replicas`` replicas of ``need`` bytes, and why some are missing or waiting ("" if
    none are). A replica whose Node is NotReady moves to a Ready Node with room; where none has room it
    stays placed on its Node (a Mac asleep or cut off comes back to the replica it runs, not to one
    deleted and loaded again)."""
    ready = {c.node: c for c in candidates if c.ready}
    chosen = [n for n in current if n in ready][:replicas]
    room = sorted((c for c in ready.values() if c.node not in chosen and c.free >= need), key=lambda c: -c.free)
    chosen += [c.node for c in room[:replicas - len(chosen)]]
    known = {c.node for c in candidates}
    waiting = [n for n in current if n in known and n not in ready][:replicas - len(chosen)]
    short = "" if len(chosen) == replicas else _why_short(need, chosen, candidates)
    if waiting:
        return chosen + waiting, (f"{len(waiting)} of {replicas} replicas wait for their NotReady Node, no Ready "
                                  f"Node having room for them: {short}")
    if len(chosen) == replicas:
        return chosen, ""
    return chosen, f"{replicas - len(chosen)} of {replicas} replicas fit no Node: {short}"


def _why_short(need: int, chosen: list[str], candidates: list[Candidate]) -> str:
    """The constraints that left replicas without a Node, each with its numbers."""
    ready = [c for c in candidates if c.ready]
    free = [c for c in ready if c.node not in chosen]
    if free:
        why = [f"each needs {gib(need)}; the most a Ready Node without one has free is {gib(max(c.free for c in free))}"]
    else:
        why = [f"one replica per Node, and each of the {len(ready)} Ready Node(s) runs one"]
    not_ready = sorted(c.node for c in candidates if not c.ready)
    if not_ready:
        why.append(f"NotReady: {', '.join(not_ready)}")
    return "; ".join(why)


def place_group(pool: list[str], ranks: int, share: int, candidates: list[Candidate]) -> tuple[list[str], str]:
    """The hosts of a group's ``ranks`` ranks after rank 0 (which runs beside the head), one a host,
    from its Topology's other hosts (``pool``): the Ready Nodes with room for a rank's ``share``,
    the most free first, then the hosts that are no Node of the cluster (their memory is not known
    here), in the Topology's order; and why there are too few ("" if there are enough)."""
    nodes = {c.node: c for c in candidates}
    room = sorted((nodes[h] for h in pool if h in nodes and nodes[h].ready and nodes[h].free >= share),
                  key=lambda c: -c.free)
    chosen = ([c.node for c in room] + [h for h in pool if h not in nodes])[:ranks]
    if len(chosen) == ranks:
        return chosen, ""
    others = "; ".join(f"Node {h} " + (f"has {gib(nodes[h].free)} free" if nodes[h].ready else "is not Ready")
                       for h in pool if h in nodes and h not in chosen)
    return chosen, (f"{ranks - len(chosen)} of its ranks fit no host of its Topology: each needs {gib(share)}; "
                    f"{others or 'no other host is listed'}")


def place_remote_groups(pool: list[str], groups: int, ranks: int, share: int, current: dict[str, list[str]],
                        candidates: list[Candidate]) -> tuple[dict[str, list[str]], str]:
    """The hosts of ``groups`` groups of ``ranks`` ranks whose rank 0 runs on a worker Node, by that
    Node: from a Topology's hosts ``pool`` (those the group beside the head does not use), a group
    keeps its hosts while none is a Node that is not Ready; a missing one's rank 0 goes to the Ready
    Node of the pool with room for a rank's ``share`` and the most free, its other ranks where
    ``place_group`` puts them; and why some are missing ("" if none are)."""
    nodes = {c.node: c for c in candidates}
    placed = {n: hosts for n, hosts in current.items() if n in nodes and set(hosts) <= set(pool)
              and all(h not in nodes or nodes[h].ready for h in hosts)}
    placed = dict(list(placed.items())[:groups])
    free = [h for h in pool if not any(h in hosts for hosts in placed.values())]
    why = ""
    while len(placed) < groups:
        first = sorted((nodes[h] for h in free if h in nodes and nodes[h].ready and nodes[h].free >= share),
                       key=lambda c: -c.free)
        if not first:
            largest = max((nodes[h].free for h in free if h in nodes and nodes[h].ready), default=0)
            why = f"the most any Ready Node of its Topology left has free is {gib(largest)}"
            break
        rest, why = place_group([h for h in free if h != first[0].node], ranks - 1, share, candidates)
        if why:
            break
        placed[first[0].node] = [first[0].node, *rest]
        free = [h for h in free if h not in placed[first[0].node]]
    if len(placed) == groups:
        return placed, ""
    return placed, (f"{groups - len(placed)} of its groups on worker Nodes fit no hosts of its Topology: "
                    f"rank 0 of each runs on a Node, and each rank needs {gib(share)}; {why}")
