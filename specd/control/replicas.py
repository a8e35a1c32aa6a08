"""A head's replicas on its worker Nodes: it applies each placed Model to the worker's
own control plane (its admin API, with the cluster token) and deletes what a worker
runs that is placed elsewhere. The worker's reconciler loads and serves it."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import aiohttp
import structlog

from ..api.manifest import API_VERSION
from .cluster import Member

log = structlog.get_logger(__name__)
ADMIN = "/apis/specd.dev/v1alpha1/models"


class RemoteReplicas:
    def __init__(self, token: str, spawn: Callable):
        self._headers = {"Authorization": f"Bearer {token}"}
        self._spawn = spawn  # runs a call; its end looks at the Model again
        self._applied: dict[tuple[str, str], tuple] = {}  # (model, node) -> (generation, node instance)
        self._busy: set[tuple[str, str]] = set()

    def ensure(self, member: Member, model: str, spec: dict[str, Any], generation: int) -> None:
        """The worker runs this generation of the Model (applied once per generation and worker instance)."""
        key, version = (model, member.name), (generation, member.instance)
        if self._applied.get(key) == version or key in self._busy:
            return
        spec = {k: v for k, v in spec.items() if k != "replicas"}  # one replica on that Node
        manifest = {"apiVersion": API_VERSION, "kind": "Model", "metadata": {"name": model}, "spec": spec}
        self._spawn(self._call(key, "PUT", f"{member.address}{ADMIN}/{model}", manifest, version), model)

    def remove(self, member: Member, model: str) -> None:
        key = (model, member.name)
        if key not in self._busy:
            self._spawn(self._call(key, "DELETE", f"{member.address}{ADMIN}/{model}", None, None), model)

    async def _call(self, key: tuple[str, str], method: str, url: str, body: Any, version: tuple | None) -> None:
        self._busy.add(key)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15), headers=self._headers) as s:
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
            log.warning("worker unreachable", url=url, error=str(exc))
        finally:
            self._busy.discard(key)
