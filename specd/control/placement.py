"""Which Nodes run a Model's replicas: placed by memory, like pods on nodes.

A replica stays where it runs while its Node is Ready; missing ones go to the
Ready Nodes with room for the Model's memory request, the most free memory
first, never two on one Node. A tensor- or pipeline-parallel group runs its
ranks where its Topology says: it fits when each of those Nodes has room for
the shares of the ranks it runs.
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


def fits_group(shares: dict[str, int], candidates: list[Candidate]) -> str:
    """Why a group's ranks do not fit the Nodes its Topology puts them on ("" if they do):
    ``shares`` is the bytes its ranks need on each of those Nodes."""
    known = {c.node: c for c in candidates}
    for node, need in shares.items():
        c = known.get(node)
        if c is None or not c.ready:
            return f"its ranks on Node {node} need {gib(need)}; the Node is not Ready"
        if c.free < need:
            return f"its ranks on Node {node} need {gib(need)}; the Node has {gib(c.free)} free"
    return ""
