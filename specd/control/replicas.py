"""A head's replicas on its worker Nodes: it applies each placed Model, with the DraftPairing
and the SpecPolicy the head chose for it, to the worker's own control plane (its admin API,
over TLS with the cluster token), and deletes what a worker runs that is placed elsewhere. The worker's
reconcilers load and serve it, speculating as the head would.

A worker holds only what its head applied, so it picks the same policy for the Model: the head
sends the Model's labels, and any policy the worker holds that would come first (by name) and
select them is one the head holds too, and would have picked."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import aiohttp
import structlog

from ..api.paths import ADMIN_PREFIX as ADMIN, API_VERSION
from ..serving.cluster import Member
from ..serving.fence import EPOCH_ANNOTATION
from ..store import StoredObject

log = structlog.get_logger(__name__)


def _chosen(obj: StoredObject | None) -> tuple[str, int] | None:
    return None if obj is None else (obj.name, obj.generation)


def _manifest(kind: str, obj: StoredObject, spec: dict[str, Any], annotations: dict[str, str] | None = None
              ) -> dict[str, Any]:
    metadata = {"name": obj.name, "labels": obj.labels, **({"annotations": annotations} if annotations else {})}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": spec}


class RemoteReplicas:
    def __init__(self, session: Callable[..., aiohttp.ClientSession], spawn: Callable):
        self._session = session  # the cluster's: TLS to the workers, with the token (``Cluster.session``)
        self._spawn = spawn  # runs a call; its end looks at the Model again
        # (model, node) -> (generation, node instance, (pairing, its generation) or None, (policy, ..) or None,
        #                   (group Topology, its spec) or None, placement epoch)
        self._applied: dict[tuple[str, str], tuple] = {}
        self._busy: set[tuple[str, str]] = set()
        self._policies: dict[tuple[str, str], str] = {}  # (model, node) -> the policy chosen for it now

    def ensure(self, member: Member, model: StoredObject, pairing: StoredObject | None,
               policy: StoredObject | None, group: dict[str, Any] | None = None, *, epoch: int) -> None:
        """The worker runs this generation of the Model with this pairing and policy, placed there at
        placement ``epoch`` (applied once per generation, pairing, policy, epoch and worker instance;
        one no longer chosen is deleted there). A group Model's replica there is a group whose rank
        0 runs on that worker: ``group`` is the spec of a Topology of its hosts, applied under the
        Model's name for the Model to refer to."""
        key = (model.name, member.name)
        if policy is None:
            self._policies.pop(key, None)
        else:
            self._policies[key] = policy.name
        topology = None if group is None else (model.name, json.dumps(group, sort_keys=True))
        version = (model.generation, member.instance, _chosen(pairing), _chosen(policy), topology, epoch)
        if self._applied.get(key) == version or key in self._busy:
            return
        spec = {k: v for k, v in model.spec.items() if k != "replicas"}  # one replica on that Node
        items = [_manifest("Model", model, spec if group is None else {**spec, "topologyRef": model.name},
                           {EPOCH_ANNOTATION: str(epoch)})]
        items += [_manifest(kind, obj, obj.spec) for kind, obj in (("DraftPairing", pairing), ("SpecPolicy", policy))
                  if obj is not None]
        if group is not None:
            items.append({"apiVersion": API_VERSION, "kind": "Topology", "metadata": {"name": model.name},
                          "spec": group})
        calls = [("POST", f"{member.address}{ADMIN}/apply", {"items": items})]
        calls += self._deletes(key, member, {"DraftPairing": version[2], "SpecPolicy": version[3],
                                             "Topology": topology})
        self._spawn(self._call(key, calls, version), model.name)

    def remove(self, member: Member, model: str) -> None:
        """The worker no longer runs the Model, nor the pairing and policy applied with it."""
        key = (model, member.name)
        self._policies.pop(key, None)
        if key in self._busy:
            return
        calls = [("DELETE", f"{member.address}{ADMIN}/models/{model}", None)]
        calls += self._deletes(key, member, {"DraftPairing": None, "SpecPolicy": None, "Topology": None})
        self._spawn(self._call(key, calls, None), model)

    def _deletes(self, key: tuple[str, str], member: Member,
                 now: dict[str, tuple[str, int] | None]) -> list[tuple[str, str, None]]:
        """Deleting what was applied with the Model on this worker instance and is no longer
        chosen: its pairing and group Topology, and its policy unless it is chosen for another Model there."""
        before = self._applied.get(key)
        if before is None or before[1] != member.instance:
            return []
        out = []
        others = {p for k, p in self._policies.items() if k[1] == member.name and k != key}
        for kind, path, was, held in (("DraftPairing", "draftpairings", before[2], set()),
                                      ("SpecPolicy", "specpolicies", before[3], others),
                                      ("Topology", "topologies", before[4], set())):
            if was is not None and (now[kind] is None or now[kind][0] != was[0]) and was[0] not in held:
                out.append(("DELETE", f"{member.address}{ADMIN}/{path}/{was[0]}", None))
        return out

    async def _call(self, key: tuple[str, str], calls: list[tuple[str, str, Any]], version: tuple | None) -> None:
        self._busy.add(key)
        try:
            async with self._session(timeout=aiohttp.ClientTimeout(total=15)) as s:
                for method, url, body in calls:
                    async with s.request(method, url, json=body) as r:
                        if r.status >= 400 and r.status != 404:
                            log.error("a worker refused a replica", url=url, method=method, status=r.status,
                                      reason=await r.text())
                            return
            if version is None:
                self._applied.pop(key, None)
            else:
                self._applied[key] = version
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("worker unreachable", replica=key, error=str(exc))
        finally:
            self._busy.discard(key)
