"""Which Nodes run a Model's replicas: placed by memory, like pods on nodes.

A replica stays where it runs while its Node is Ready; missing ones go to the
Ready Nodes with room for the Model's memory request, the most free memory
first, never two on one Node. A tensor- or pipeline-parallel group runs rank 0
beside the head and its other ranks on hosts of its Topology, the Nodes with
room for a rank's share first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.memory import gib


@dataclass(frozen=True)
class Candidate:
    node: str
    free: int  # bytes the Node could still give (its own replica of this Model not counted)
    ready: bool


def place(replicas: int, need: int, current: list[str], candidates: list[Candidate]) -> tuple[list[str], str]:
    """The Nodes for ``replicas`` replicas of ``need`` bytes, and why some are missing ("" if none are)."""
    ready = {c.node: c for c in candidates if c.ready}
    chosen = [n for n in current if n in ready][:replicas]
    room = sorted((c for c in ready.values() if c.node not in chosen and c.free >= need), key=lambda c: -c.free)
    chosen += [c.node for c in room[:replicas - len(chosen)]]
    if len(chosen) == replicas:
        return chosen, ""
    largest = max((c.free for c in ready.values() if c.node not in chosen), default=0)
    return chosen, (f"{replicas - len(chosen)} of {replicas} replicas fit no Node: each needs {gib(need)}; "
                    f"the most any other Ready Node has free is {gib(largest)}")


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
