"""A worker daemon's side of the cluster: join the head, then heartbeat.

The worker serves its replicas with its own engines, control plane and state
directory, and takes control only from the head: its admin API needs the same
cluster token (``--join`` sets it as the admin token) and answers only on the
worker's cluster port, over TLS. Before its first join the agent fetches the
head's certificate authority and keeps it only if its hash is the one the join
token pins; every call to the head then trusts that CA alone. Each join sends a
certificate signing request and serves the head with the certificate it signs
(``serving/tls.py``). Each heartbeat carries what the head places and routes
by: the node's memory and, for each Model it serves, whether it is ready and how
busy it is. Its answer says what memory the head's groups hold here for ranks
the head started on this Mac, which the worker then counts as held
(``on_reserved``), and where the head places each Model now, which fences a
replica the head moved away (``serving/fence.py``).
"""

from __future__ import annotations

import asyncio
import ssl
import uuid
from pathlib import Path
from typing import Any, Callable

import aiohttp
import structlog

from ..serving.cluster import HEARTBEAT_SECONDS, MISSED_HEARTBEATS, versions
from ..serving.fence import PlacementFence
from ..serving.tls import CertificateMismatch, JoinToken, NodeIdentity, client_context, host_of, pinned_ca

log = structlog.get_logger(__name__)
REJOIN_SECONDS = 5.0  # after a refusal or an unreachable head


class NodeAgent:
    def __init__(self, head: str, token: JoinToken, name: str, address: str, report: Callable[[], dict[str, Any]],
                 identity: NodeIdentity, tls_dir: Path,
                 on_reserved: Callable[[dict[str, int]], None] = lambda reserved: None):
        self.head, self.name, self.address, self.report = head.rstrip("/"), name, address, report
        self.token, self.identity, self.tls_dir = token, identity, tls_dir
        self.on_reserved = on_reserved
        self._headers = {"Authorization": f"Bearer {token.secret}"}
        self._ssl: ssl.SSLContext | None = None  # the pinned CA's, once fetched
        self.instance = uuid.uuid4().hex  # this daemon process: a restarted one is a new instance
        self.joined = False
        self.refusal = ""  # why the head last refused this Node, or why this Node refused the head
        # the head's placements, as its heartbeat answers say (the replica API reads it); its lease is
        # as long as the head waits before it counts this Node NotReady
        self.fence = PlacementFence(MISSED_HEARTBEATS * HEARTBEAT_SECONDS)

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=self._headers) as session:
            while True:
                try:
                    if self._ssl is None:
                        self._ssl = client_context(await pinned_ca(self.head, self.token))
                    await (self._heartbeat(session) if self.joined else self._join(session))
                except (CertificateMismatch, aiohttp.ClientConnectorCertificateError) as exc:
                    self.refusal = f"refused the head's certificate: {exc}"
                    log.error("the head presents a certificate the join token does not pin", head=self.head,
                              error=str(exc))
                    self.joined, self._ssl = False, None
                    await asyncio.sleep(REJOIN_SECONDS)
                    continue
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    log.warning("head unreachable", head=self.head, error=str(exc))
                    self.joined = False
                    await asyncio.sleep(REJOIN_SECONDS)
                    continue
                await asyncio.sleep(HEARTBEAT_SECONDS if self.joined else REJOIN_SECONDS)

    async def _join(self, session: aiohttp.ClientSession) -> None:
        body = {"address": self.address, "instance": self.instance, "versions": versions(),
                "csr": self.identity.signing_request(), **self.report()}
        async with session.post(f"{self.head}/cluster/v1/nodes/{self.name}/join", json=body, ssl=self._ssl) as r:
            if r.status == 200:
                answer = await r.json()
                self.identity.certify(answer["certificate"], self.tls_dir)
                self.fence.heard(answer.get("placements", {}))
                self.joined, self.refusal = True, ""
                log.info("joined the cluster", head=self.head, node=self.name, serves_as=host_of(self.address))
                return
            self.refusal = (await r.json()).get("message", r.reason)
            log.error("the head refused this node", head=self.head, status=r.status, reason=self.refusal)

    async def _heartbeat(self, session: aiohttp.ClientSession) -> None:
        body = {"instance": self.instance, "status": self.report()["status"]}
        async with session.post(f"{self.head}/cluster/v1/nodes/{self.name}/heartbeat", json=body,
                                ssl=self._ssl) as r:
            if r.status != 200:  # the head restarted without us, or refuses us now: join again
                self.joined = False
                log.warning("heartbeat refused", status=r.status)
                return
            answer = await r.json()
            self.fence.heard(answer.get("placements", {}))
            self.on_reserved(answer.get("reserved", {}))
