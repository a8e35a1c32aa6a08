"""A head's replicas on its worker Nodes: it applies each placed Model, with the DraftPairing
the head chose for it, to the worker's own control plane (its admin API, with the cluster
token), and deletes what a worker runs that is placed elsewhere. The worker's reconcilers load
and serve it, speculating as the head would."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import aiohttp
import structlog

from ..api.manifest import API_VERSION
from .cluster import Member
from .store import StoredObject

log = structlog.get_logger(__name__)
ADMIN = "/apis/specd.dev/v1alpha1"


class RemoteReplicas:
    def __init__(self, token: str, spawn: Callable):
        self._headers = {"Authorization": f"Bearer {token}"}
        self._spawn = spawn  # runs a call; its end looks at the Model again
        # (model, node) -> (generation, node instance, (pairing, its generation) or None)
        self._applied: dict[tuple[str, str], tuple] = {}
        self._busy: set[tuple[str, str]] = set()

    def ensure(self, member: Member, model: str, spec: dict[str, Any], generation: int,
               pairing: StoredObject | None) -> None:
        """The worker runs this generation of the Model with this pairing (applied once per
        generation, pairing and worker instance; a pairing no longer chosen is deleted there)."""
        key = (model, member.name)
        chosen = None if pairing is None else (pairing.name, pairing.generation)
        version = (generation, member.instance, chosen)
        if self._applied.get(key) == version or key in self._busy:
            return
        spec = {k: v for k, v in spec.items() if k != "replicas"}  # one replica on that Node
        items = [{"apiVersion": API_VERSION, "kind": "Model", "metadata": {"name": model}, "spec": spec}]
        if pairing is not None:
            items.append({"apiVersion": API_VERSION, "kind": "DraftPairing", "metadata": {"name": pairing.name},
                          "spec": pairing.spec})
        before = self._applied.get(key)
        stale = before[2][0] if before and before[2] and before[1] == member.instance and (
            pairing is None or before[2][0] != pairing.name) else None
        calls = [("POST", f"{member.address}{ADMIN}/apply", {"items": items})]
        if stale is not None:
            calls.append(("DELETE", f"{member.address}{ADMIN}/draftpairings/{stale}", None))
        self._spawn(self._call(key, calls, version), model)

    def remove(self, member: Member, model: str) -> None:
        """The worker no longer runs the Model, nor the pairing applied with it."""
        key = (model, member.name)
        if key in self._busy:
            return
        calls = [("DELETE", f"{member.address}{ADMIN}/models/{model}", None)]
        applied = self._applied.get(key)
        if applied and applied[2]:
            calls.append(("DELETE", f"{member.address}{ADMIN}/draftpairings/{applied[2][0]}", None))
        self._spawn(self._call(key, calls, None), model)

    async def _call(self, key: tuple[str, str], calls: list[tuple[str, str, Any]], version: tuple | None) -> None:
        self._busy.add(key)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15), headers=self._headers) as s:
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
