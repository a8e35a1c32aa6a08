"""The Node reconciler (on a head): each joined Node's health, and what it runs that it should not.

A Node is looked at on each heartbeat and when its next one is due: one that missed
``MISSED_HEARTBEATS`` becomes NotReady. When a Node's health or the replicas it reports
change, every Model is looked at again, so replicas on a lost Node are placed elsewhere
and a Node that comes back is given what is placed on it. What a Ready Node serves that
no placement puts there (a Model deleted, or moved while the Node was away) is deleted
from it.
"""

from __future__ import annotations

from typing import Callable

from ...serving.cluster import Cluster, Member
from ..manager import Result
from ..replicas import RemoteReplicas
from ..state import ModelState
from ...store import Store

KIND = "Node"


def _reported(member: Member) -> tuple:
    """What the head places and routes by: the Node's health, its daemon and its replicas' readiness."""
    served = member.status.get("served", {})
    return member.ready, member.instance, tuple(sorted((m, bool(s.get("ready")), s.get("specPolicy") or "")
                                                  for m, s in served.items()))


class NodeReconciler:
    kind = KIND

    def __init__(self, store: Store, cluster: Cluster, states: dict[str, ModelState], remote: RemoteReplicas,
                 look_at_models: Callable[[], None]):
        self.store, self.cluster, self.states, self.remote = store, cluster, states, remote
        self.look_at_models = look_at_models
        self._seen: dict[str, tuple] = {}

    def names(self) -> list[str]:
        return list(self.cluster.members)

    def reconcile(self, name: str) -> Result:
        member = self.cluster.members.get(name)
        if member is None:
            return Result()
        self.cluster.check_health(member)
        reported = _reported(member)
        if self._seen.get(name) != reported:  # first looked at (a head restarted: NotReady until heard from)
            self._seen[name] = reported
            self.cluster.write_status(member)
            self.look_at_models()
        if not member.ready:
            return Result()
        self._remove_strays(member)
        return Result(max(0.05, self.cluster.silent_for(member) + 0.05))

    def _remove_strays(self, member: Member) -> None:
        for model in member.status.get("served", {}):
            state = self.states.get(model)
            if state is None and self.store.find("Model", model) is not None:
                continue  # stored but not looked at yet (a head that just started)
            if state is None or member.name not in state.placed.replica_nodes:
                self.remote.remove(member, model)
