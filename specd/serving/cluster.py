"""The head's view of the cluster: the Nodes that joined it, and their health.

A Mac joins as k3s agents join a k3s server: its daemon is started with
``--join HEAD --token-file FILE`` (the join token the head wrote, which pins
the head's certificate authority) and calls the head's cluster API over TLS
with that token (``control/agent.py``, ``serving/tls.py``). The head signs the
Node a serving certificate for the address it advertises, and reaches it only
over TLS, trusting that certificate and no other (``Cluster.session``). The head admits it only with the right token, a
name no other live Node holds, and the same specd and MLX versions; every
refusal is an event on the Node. A joined Node is stored (kind ``Node``) in the
head's SQLite store, which stays the only source of truth: a restarted head
knows its Nodes, and each is ``NotReady`` until its next heartbeat. A Node
that misses ``MISSED_HEARTBEATS`` heartbeats is ``NotReady`` with the reason
(``reconcilers/node.py`` checks each Node when its heartbeat is due).
"""

from __future__ import annotations

import hmac
import importlib.metadata
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import mlx.core as mx

from ..store import NotFound, Store
from .tls import ClusterCA, host_of

HEARTBEAT_SECONDS = 2.0
MISSED_HEARTBEATS = 3


def versions() -> dict[str, str]:
    """What every Node of a cluster must run alike."""
    return {"specd": importlib.metadata.version("specd"), "mlx": mx.__version__}


class Refused(Exception):
    """A join or heartbeat the head does not accept (HTTP status, reason, message)."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass
class Member:
    """A joined Node as the head knows it."""

    name: str
    address: str  # its daemon's URL: where its replicas are served and controlled
    instance: str  # its daemon process: a restarted one joins again
    chip: str = ""
    allocatable: int = 0
    capacity: int = 0
    status: dict[str, Any] = field(default_factory=dict)  # its last heartbeat: memory and Models
    last_seen: float | None = None  # monotonic; None: not seen since the head started
    ready: bool = False
    reason: str = "NotSeen"

    def model(self, name: str) -> dict[str, Any] | None:
        """What the Node reported of a Model it serves."""
        return self.status.get("served", {}).get(name)


class Cluster:
    def __init__(self, store: Store, token: str, ca: ClusterCA):
        self.store = store
        self.token = token
        self._token = f"Bearer {token}".encode()
        self.ca = ca
        self._client_ssl = ca.client_context()
        self.members: dict[str, Member] = {}
        self.started = time.monotonic()
        self.on_heartbeat: Callable[[str], None] = lambda name: None  # the Node reconciler looks at it
        # memory the head's groups hold on Nodes for ranks it started there: Node -> {holder: bytes},
        # sent back on each heartbeat so that the worker counts it as held
        self.reserved: dict[str, dict[str, int]] = {}
        # each Model's placement epoch and the Nodes its replicas are placed on, told to every Node
        # on its heartbeats so a replica moved away is fenced (``serving/fence.py``)
        self.placements: dict[str, tuple[int, list[str]]] = {}
        for obj in store.list("Node"):  # a restarted head knows its Nodes, each NotReady until it is heard from
            spec = obj.spec
            self.members[obj.name] = Member(obj.name, spec["address"], spec.get("instance", ""), spec.get("chip", ""),
                                            spec.get("allocatable", 0), spec.get("capacity", 0))

    def session(self, **kwargs) -> aiohttp.ClientSession:
        """A client of the workers: over TLS, trusting only certificates this cluster's CA signed, with the token."""
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._client_ssl),
                                     headers={"Authorization": f"Bearer {self.token}"}, **kwargs)

    def authorize(self, header: str) -> None:
        if not hmac.compare_digest(header.encode("utf-8", "surrogateescape"), self._token):
            raise Refused(401, "Unauthorized", "a valid cluster token is required")

    def join(self, name: str, header: str, body: dict[str, Any]) -> tuple[Member, bytes]:
        """Admit a Node (or the same Node again after its daemon restarted), and sign its serving
        certificate for the host of the address it advertises (whatever else its request names)."""
        try:
            self.authorize(header)
            address = str(body["address"])
            if not address.startswith("https://") or not host_of(address):
                raise Refused(400, "BadRequest", f"a Node's address must be https://HOST:PORT (its cluster port), "
                                                 f"not {address[:200]!r}")
            mine = versions()
            theirs = {k: body.get("versions", {}).get(k) for k in mine}
            if theirs != mine:
                raise Refused(422, "VersionMismatch", f"the Node runs {_shown(theirs)}; this cluster runs {_shown(mine)}")
            known = self.members.get(name)
            if known is not None and known.ready and known.instance != body.get("instance"):
                raise Refused(409, "NameInUse", f'a live Node already holds the name "{name}" (at {known.address})')
            try:
                certificate = self.ca.sign(str(body["csr"]).encode(), [host_of(address)])
            except (KeyError, ValueError) as err:
                raise Refused(400, "BadRequest", f"the join carries no valid certificate signing request (csr): "
                                                 f"{str(err)[:200]}") from None
        except Refused as refused:
            self.store.record_event("Node", name, "Warning", refused.reason, refused.message)
            raise
        member = Member(name, address, str(body.get("instance", "")), str(body.get("chip", "")),
                        int(body.get("allocatable", 0)), int(body.get("capacity", 0)))
        spec = {"address": member.address, "instance": member.instance, "chip": member.chip,
                "allocatable": member.allocatable, "capacity": member.capacity, "versions": mine}
        self.store.apply([{"kind": "Node", "name": name, "labels": {}, "annotations": {}, "spec": spec}], server=True)
        self.members[name] = member
        self.store.record_event("Node", name, "Normal", "Joined", f"joined from {member.address}")
        self.heartbeat(name, header, {"instance": member.instance, "status": body.get("status", {})})
        return member, certificate

    def heartbeat(self, name: str, header: str, body: dict[str, Any]) -> None:
        self.authorize(header)
        member = self.members.get(name)
        if member is None or member.instance != body.get("instance"):
            raise Refused(410, "JoinAgain", f'Node "{name}" is not joined as this daemon: join again')
        member.status = body.get("status", {})
        member.last_seen = time.monotonic()
        if not member.ready:
            member.ready, member.reason = True, "HeartbeatReceived"
            self.store.record_event("Node", name, "Normal", "NodeReady", "heartbeats received")
            self.write_status(member)
        self.on_heartbeat(name)

    def place(self, model: str, epoch: int, nodes: list[str]) -> None:
        """The Model's replicas are placed on ``nodes`` at placement ``epoch``."""
        self.placements[model] = (epoch, list(nodes))

    def unplace(self, model: str) -> None:
        """The Model is gone: its replicas anywhere are deleted, not fenced."""
        self.placements.pop(model, None)

    def placements_for(self, node: str) -> dict[str, Any]:
        """What a Node's heartbeat answer says of placements: every Model's epoch, and those placed there."""
        return {"epochs": {m: epoch for m, (epoch, _) in self.placements.items()},
                "placed": sorted(m for m, (_, nodes) in self.placements.items() if node in nodes)}

    def reserve(self, model: str, on_nodes: dict[str, int]) -> None:
        """The Model's group holds these bytes on these Nodes now (nothing elsewhere)."""
        holder = rank_holder(model)
        for node in set(self.reserved) | set(on_nodes):
            held = self.reserved.setdefault(node, {})
            if node in on_nodes:
                held[holder] = on_nodes[node]
            else:
                held.pop(holder, None)

    def free_on(self, member: Member, holder: str | None = None) -> int:
        """What a Node could still give: its allocatable less what it last reported requested, and
        less what the head reserved there since; ``holder``'s own reservation counted as free."""
        reported = {m.get("name"): m.get("requested", 0) for m in member.status.get("models", [])}
        reserved = self.reserved.get(member.name, {})
        free = member.allocatable - member.status.get("requested", 0)
        free -= sum(held for name, held in reserved.items() if name not in reported)
        if holder in reserved:
            free += reported.get(holder, reserved[holder])
        return free

    def settling(self, member: Member) -> float:
        """Seconds a Node this head has not heard from since it started is still given to send a
        heartbeat, before what runs there counts as lost (<= 0: it was heard from, or its time is up)."""
        if member.last_seen is not None:
            return 0.0
        return self.started + MISSED_HEARTBEATS * HEARTBEAT_SECONDS - time.monotonic()

    def silent_for(self, member: Member) -> float:
        """Seconds until a Ready Node that sends no more heartbeats is NotReady (<= 0: it is due)."""
        if member.last_seen is None:
            return 0.0
        return member.last_seen + MISSED_HEARTBEATS * HEARTBEAT_SECONDS - time.monotonic()

    def check_health(self, member: Member) -> None:
        """A Ready Node not heard from lately becomes NotReady, with an event."""
        if member.ready and self.silent_for(member) < 0:
            member.ready = False
            member.reason = "NodeStatusUnknown"
            silent = "" if member.last_seen is None else f" for {time.monotonic() - member.last_seen:.0f}s"
            self.store.record_event("Node", member.name, "Warning", "NodeNotReady", f"no heartbeat{silent}")
            self.write_status(member)

    def ready(self) -> list[Member]:
        return [m for m in self.members.values() if m.ready]

    def write_status(self, member: Member) -> None:
        try:
            self.store.set_status("Node", member.name, {"conditions": [self.condition(member)]})
        except NotFound:
            pass

    def condition(self, member: Member) -> dict[str, Any]:
        seen = "never since the head started" if member.last_seen is None else \
            f"last heartbeat {time.monotonic() - member.last_seen:.1f}s ago"
        return {"type": "Ready", "status": "True" if member.ready else "False", "reason": member.reason,
                "message": seen}


def rank_holder(model: str) -> str:
    """How a Node lists the memory it holds for ranks of a Model's group the head started there."""
    return f"{model} ranks"


def _shown(v: dict[str, str | None]) -> str:
    return ", ".join(f"{k} {v[k]}" for k in v)
