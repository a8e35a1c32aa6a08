"""What the control plane knows of a Model, in three parts: what is desired (read from the
store at every look), what runs (the engine's build and the loads in flight), and where its
replicas and ranks are placed. What the request path reads is the ``ServedModel`` entry of
the serving registry, which the Model reconciler writes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..api.manifest import DraftPairingSpec, ModelSpec, SpecPolicySpec, TopologySpec
from ..core.download import DownloadProgress
from ..core.request import Method, SpeculationConfig
from ..engine.resources import MemoryRequest
from ..serving.registry import ServedModel
from ..speculation.config import PolicySettings
from ..store import StoredObject


@dataclass(frozen=True)
class Pairing:
    """A DraftPairing as applied to a model (name and generation identify it)."""

    name: str
    generation: int
    spec: DraftPairingSpec

    @property
    def method(self) -> Method:
        return Method(self.spec.method)

    def speculation(self) -> SpeculationConfig:
        s = self.spec
        return SpeculationConfig(self.method, s.num_speculative_tokens, s.ngram_min, s.ngram_max,
                                 s.tree_top_k, s.tree_tokens)


@dataclass(frozen=True)
class Policy:
    name: str
    generation: int
    spec: SpecPolicySpec

    def settings(self) -> PolicySettings:
        """What the engine's controller takes (the spec less its selector)."""
        s = self.spec
        return PolicySettings(s.enabled, s.mode, s.max_speculative_tokens, s.disable_by_batch_size,
                              s.acceptance_rate_threshold, s.ema_alpha, s.probe_interval)


@dataclass(frozen=True)
class Desired:
    """A Model as the store wants it now, with the pairing, policy and topology it takes."""

    obj: StoredObject
    spec: ModelSpec
    pairing: Pairing | None
    policy: Policy | None
    topology: StoredObject | None = None  # its Topology object (spec.topologyRef), if stored
    topology_spec: TopologySpec | None = None

    @property
    def generation(self) -> int:
        return self.obj.generation

    @property
    def group_key(self) -> tuple | None:
        """What a group is started for: a change of its topology's generation or its pairing restarts it."""
        return None if self.topology is None else (self.topology.name, self.topology.generation, self.pairing)


@dataclass
class Running:
    """What runs for the Model (the build its engine came from) and the work towards the next one."""

    generation: int  # the Model generation of ``spec``
    spec: ModelSpec
    load_seconds: float | None = None
    weight_bytes: int | None = None
    pairing: Pairing | None = None  # applied to the engine
    pairing_error: str = ""  # why ``pairing``'s drafter did not attach
    policy: Policy | None = None  # applied to the engine
    task: asyncio.Task | None = None  # slow work in flight: a load, a memory request's read, a drafter's attach
    loading_generation: int | None = None
    group_key: tuple | None = None  # a group: what it was started for (``Desired.group_key``)
    restarts: int = 0  # a group's restarts in a row
    last_failure: str = ""
    faults_seen: int = 0  # engine faults already reported as events
    failures: int = 0  # loads in a row that failed for a reason that can pass (retried with backoff)
    restart: bool = False  # rollout restart asked for a fresh load
    # memory: the request of the serving engine, of the one loading, and of the spec (once read)
    request: MemoryRequest | None = None
    loading_request: MemoryRequest | None = None
    spec_request: tuple[tuple, MemoryRequest] | None = None  # (what it was computed for, the request)
    download: DownloadProgress | None = None  # its checkpoints' download, while reading its request


@dataclass
class Placed:
    """Where the Model's replicas, and its groups' ranks, are placed."""

    replica_nodes: list[str] = field(default_factory=list)  # on a head: the Nodes its replicas are placed on
    epoch: int | None = None  # on a head: its placement epoch, moved when replica_nodes change (``serving/fence.py``)
    replicas_short: str = ""  # why some replicas fit no Node
    group_memory: dict[str, int] = field(default_factory=dict)  # a group's bytes on each Node its ranks run on
    group_hosts: list[str] = field(default_factory=list)  # the hosts of its group's ranks, rank 0 first
    group_reserved: dict[str, int] = field(default_factory=dict)  # on a head: what it reserved for them on Nodes
    # on a head: its further replicas' groups, by the worker Node that runs rank 0 (their hosts, rank 0
    # first), and what their other ranks hold on Nodes
    remote_groups: dict[str, list[str]] = field(default_factory=dict)
    remote_group_memory: dict[str, int] = field(default_factory=dict)


@dataclass
class ModelState:
    """One Model in the control plane: its serving entry, what runs, where it is placed."""

    serving: ServedModel
    running: Running
    placed: Placed = field(default_factory=Placed)

    @property
    def name(self) -> str:
        return self.serving.name

    def loading(self, request: MemoryRequest | None) -> None:
        """A load holds ``request`` of the node's memory now (None: no load does)."""
        self.running.loading_request = request
        self.serving.loading = request is not None
