"""A worker daemon's side of the cluster: join the head, then heartbeat.

The worker serves its replicas with its own engines, control plane and state
directory, and takes control only from the head: its admin API needs the same
cluster token (``--join`` sets it as the admin token). Each heartbeat carries
what the head places and routes by: the node's memory and, for each Model it
serves, whether it is ready and how busy it is. Its answer says what memory the
head's groups hold here for ranks the head started on this Mac, which the
worker then counts as held (``on_reserved``).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable

import aiohttp
import structlog

from ..serving.cluster import HEARTBEAT_SECONDS, versions

log = structlog.get_logger(__name__)
REJOIN_SECONDS = 5.0  # after a refusal or an unreachable head


class NodeAgent:
    def __init__(self, head: str, token: str, name: str, address: str, report: Callable[[], dict[str, Any]],
                 on_reserved: Callable[[dict[str, int]], None] = lambda reserved: None):
        self.head, self.name, self.address, self.report = head.rstrip("/"), name, address, report
        self.on_reserved = on_reserved
        self._headers = {"Authorization": f"Bearer {token}"}
        self.instance = uuid.uuid4().hex  # this daemon process: a restarted one is a new instance
        self.joined = False
        self.refusal = ""  # why the head last refused this Node

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=self._headers) as session:
            while True:
                try:
                    await (self._heartbeat(session) if self.joined else self._join(session))
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    log.warning("head unreachable", head=self.head, error=str(exc))
                    self.joined = False
                    await asyncio.sleep(REJOIN_SECONDS)
                    continue
                await asyncio.sleep(HEARTBEAT_SECONDS if self.joined else REJOIN_SECONDS)

    async def _join(self, session: aiohttp.ClientSession) -> None:
        body = {"address": self.address, "instance": self.instance, "versions": versions(), **self.report()}
        async with session.post(f"{self.head}/cluster/v1/nodes/{self.name}/join", json=body) as r:
            if r.status == 200:
                self.joined, self.refusal = True, ""
                log.info("joined the cluster", head=self.head, node=self.name)
                return
            self.refusal = (await r.json()).get("message", r.reason)
            log.error("the head refused this node", head=self.head, status=r.status, reason=self.refusal)

    async def _heartbeat(self, session: aiohttp.ClientSession) -> None:
        body = {"instance": self.instance, "status": self.report()["status"]}
        async with session.post(f"{self.head}/cluster/v1/nodes/{self.name}/heartbeat", json=body) as r:
            if r.status != 200:  # the head restarted without us, or refuses us now: join again
                self.joined = False
                log.warning("heartbeat refused", status=r.status)
                return
            self.on_reserved((await r.json()).get("reserved", {}))
