"""Placing a Model on a Topology: which rank runs where, and what MLX needs to know.

A tensor-parallel group is ``tensorParallelSize`` processes, rank ``r`` on
``hosts[r]``.  Rank 0 runs on the daemon's own host (it talks to the daemon
over a socket); each rank learns its peers from the hostfile that
``mx.distributed`` reads at init — the same file ``mlx.launch`` would write:

- ring: ``MLX_HOSTFILE`` is a JSON list, per rank, of ``"ip:port"`` strings;
- jaccl: ``MLX_IBV_DEVICES`` is a JSON matrix, ``[i][j]`` the RDMA device host
  ``i`` uses to reach host ``j`` (null on the diagonal), and
  ``MLX_JACCL_COORDINATOR`` is rank 0's ``ip:port``.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from dataclasses import asdict, dataclass, field

from ..api.manifest import ModelSpec, TopologySpec
from ..core.memory import host_memory_bytes
from ..core.prefix import default_max_bytes

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def is_local(address: str) -> bool:
    """Whether ``address`` (a name or an IP) is this machine: can we bind to it?"""
    if address in LOOPBACK:
        return True
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class GroupPlan:
    """Everything a rank process needs to join its group and build its engine
    (sent to every rank as JSON in ``SPECD_GROUP``)."""

    model: str  # the Model's name
    source: str  # where every rank loads the target from
    backend: str  # ring | jaccl
    world_size: int
    env: dict[str, str]  # MLX's variables, the same for every rank (hostfile contents inline)
    control: str  # rank 0 connects back to the daemon here: "host:port"
    token: str  # proves to the daemon that the connection is its own rank 0
    engine: dict = field(default_factory=dict)  # EngineConfig fields
    speculation: dict | None = None  # SpeculationConfig fields of the model's DraftPairing
    draft_source: str | None = None  # replicated on every rank
    revision: str | None = None  # of a hub source
    parallelism: str = "tensor"  # tensor | pipeline | auto: how the ranks split the target

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GroupPlan:
        return cls(**json.loads(text))


def mlx_environment(topology: TopologySpec, ports: list[int]) -> dict[str, str]:
    """The variables ``mx.distributed.init`` reads (hostfile contents inline:
    each rank writes them to a file of its own before init)."""
    hosts = topology.hosts[: topology.tensor_parallel_size]
    if topology.backend == "ring":
        return {"SPECD_MLX_HOSTFILE": json.dumps([[f"{h.address}:{p}"] for h, p in zip(hosts, ports)])}
    devices = [[None if i == j else h.rdma_devices.get(peer.name) for j, peer in enumerate(hosts)]
               for i, h in enumerate(hosts)]
    return {"SPECD_MLX_IBV_DEVICES": json.dumps(devices),
            "MLX_JACCL_COORDINATOR": f"{hosts[0].address}:{ports[0]}",
            "MLX_METAL_FAST_SYNCH": "1"}  # what mlx.launch users are told to set for JACCL


def check_placement(topology: TopologySpec) -> None:
    """Refuse a group that cannot start, with the reason a user can act on."""
    hosts = topology.hosts[: topology.tensor_parallel_size]
    if not is_local(hosts[0].address):
        raise ValueError(f"rank 0 runs next to the daemon, but hosts[0] ({hosts[0].name}, {hosts[0].address}) "
                         "is not this machine; list the daemon's host first")
    if topology.backend == "jaccl":
        missing = [f"{h.name}->{p.name}" for h in hosts for p in hosts
                   if p is not h and p.name not in h.rdma_devices]
        if missing:
            raise ValueError(f"jaccl needs an RDMA device for every pair of hosts; missing {', '.join(missing)} "
                             "(see `mlx.distributed_config --backend jaccl`)")


def group_ports(topology: TopologySpec) -> list[int]:
    """One listening port per rank: free ones when every rank is on this
    machine, else ``port + rank`` (the firewall needs to know them)."""
    hosts = topology.hosts[: topology.tensor_parallel_size]
    if topology.port is None and all(is_local(h.address) for h in hosts):
        return [free_port(h.address if h.address != "localhost" else "127.0.0.1") for h in hosts]
    base = topology.port or 52400
    return [base + r for r in range(len(hosts))]


def rank_command(topology: TopologySpec, rank: int, plan: GroupPlan) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start ``rank`` on its host:
    directly when the host is this machine, else through ``ssh`` (the same
    trust model as ``mlx.launch``: passwordless ssh between the hosts)."""
    host = topology.hosts[rank]
    env = {"SPECD_GROUP": plan.to_json(), "MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(plan.world_size)}
    if topology.threads_per_rank:
        env.update(OMP_NUM_THREADS=str(topology.threads_per_rank),
                   OPENBLAS_NUM_THREADS=str(topology.threads_per_rank))
    if topology.launcher == "local" or is_local(host.address):
        return [sys.executable, "-m", "specd.cli", "rank"], {**os.environ, **env}
    remote = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    rsh = shlex.split(os.environ.get("SPECD_RSH", "ssh -o BatchMode=yes"))  # like rsync's -e / GIT_SSH_COMMAND
    return [*rsh, host.name, f"env {remote} {shlex.quote(topology.specd_command)} rank"], dict(os.environ)


def engine_fields(spec: ModelSpec) -> dict:
    return {"max_batch_size": spec.max_batch_size, "max_waiting": spec.max_waiting,
            "prefill_step_tokens": spec.prefill_step_tokens, "max_context": spec.max_context,
            # every rank must evict alike: by one budget (the daemon host's default), never by its own memory
            "prefix_cache_bytes": (default_max_bytes() if spec.prefix_cache_max_bytes is None
                                   else spec.prefix_cache_max_bytes), "watch_memory_limit": False,
            # and preempt alike: one KV budget, the default a share of the daemon host's memory
            "kv_cache_bytes": spec.kv_cache_max_bytes, "host_memory": host_memory_bytes(),
            "kv_bits": spec.kv_cache_bits, "kv_group_size": spec.kv_cache_group_size,
            # a group steps in lockstep, its ranks exchanging inputs between steps: each step whole
            "decode_ahead": False}
