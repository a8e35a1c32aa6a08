"""The daemon's side of a tensor-parallel Model: start its ranks, talk to rank 0, watch them.

``GroupClient`` implements ``ServingEngine`` like a local ``Engine``, but its
engine runs in the rank processes.  Ranks are child processes (or ssh
sessions) rather than the daemon itself because an ``mx.distributed`` group
is process-wide and cannot be rebuilt once a peer is gone: a failed group is
killed whole and a fresh one started, while the daemon keeps serving its
other models.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from dataclasses import asdict
from types import SimpleNamespace
from typing import AsyncIterator, Callable

import structlog
from prometheus_client.parser import text_string_to_metric_families

from ..api.manifest import ModelSpec, TopologySpec
from ..core.loader import load_tokenizer
from ..core.request import GenerationRequest, StepOutput
from ..engine.engine import EngineOverloaded, EngineUnavailable
from ..engine.interface import ServingEngine, drain_within
from ..engine.scheduler import check_request
from ..core.request import Method, NO_SPECULATION, SpeculationConfig
from ..speculation.config import PolicySettings
from . import wire
from .topology import (
    GroupPlan,
    check_placement,
    engine_fields,
    group_ports,
    mlx_environment,
    rank_command,
)

log = structlog.get_logger(__name__)
_REJECTIONS = {"EngineOverloaded": EngineOverloaded, "EngineUnavailable": EngineUnavailable,
               "ValueError": ValueError}
# What a rank's collectives say when a peer went away first (MLX's ring backend): an effect, not a cause.
PEER_LOST = ("connection to a peer was lost",)
EXIT_GRACE = 2.0  # seconds a failing group waits for its ranks' exits before naming the first


class GroupClient:
    """A running tensor-parallel group, seen from the daemon."""

    def __init__(self, name: str, topology: TopologySpec, procs: list[subprocess.Popen], tokenizer,
                 info: dict, speculation: SpeculationConfig, on_failure: Callable[[], None],
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.name = name
        self.topology = topology
        self.procs = procs
        self.tokenizer = tokenizer
        self.max_context: int = info["max_context"]
        self.vocab_size: int = info["vocab_size"]
        self.drafter: Method | None = Method(info["drafter"]) if info["drafter"] else None
        self.weight_bytes: int = info["weight_bytes"]
        self.parallelism: str = info["parallelism"]  # the split the ranks run: the Topology's, or auto's choice
        self.split_probe: dict | None = info["probe"]  # auto: each split's timed decode step, and refusals
        self.speculation = speculation
        self.failure: str | None = None  # set once; the reconciler restarts the group
        self.vision = None
        self.image_refusal = "a tensor- or pipeline-parallel group takes no images yet"
        self.fault: str | None = None  # a rank's step fault fails the group (``failure``)
        self.faults = 0
        self.on_failure = on_failure  # the reconciler restarts the group
        self.status: dict = {}
        self._reader, self._writer = reader, writer
        self._streams: dict[str, asyncio.Queue] = {}
        self._accepting = True
        self._stopping = False
        self._progress = time.monotonic()  # the last time rank 0 reported a finished step
        self._tasks: list[asyncio.Task] = []
        self._exits: dict[int, tuple[float, int]] = {}  # rank: (when the daemon first saw it gone, code)
        self._fatal: str | None = None  # the error rank 0 reported, if it did
        self._settling = False  # a failure was seen; its cause is being collected

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def ranks(self) -> list[dict]:
        hosts = self.topology.hosts
        return [{"rank": r, "host": hosts[r].name, "pid": p.pid} for r, p in enumerate(self.procs)]

    def check_prompt(self, request: GenerationRequest) -> None:
        check_request(request, self.name, self.drafter, self.max_context, self.vocab_size)

    def speculation_status(self) -> dict:
        return self.status.get("speculation", {"default": self.speculation.method})

    def prefix_cache_status(self) -> dict:
        return self.status.get("prefixCache", {})

    def kv_cache_status(self) -> dict:
        return self.status.get("kvCache", {})

    def set_policy(self, policy: PolicySettings | None, name: str | None) -> None:
        self._send(("policy", policy, name))

    def group_status(self) -> dict:
        return {"ranks": self.ranks(), "parallelism": self.parallelism,
                **({"splitProbe": self.split_probe} if self.split_probe else {}), "steps": self.status.get("steps"),
                "controlBytes": self.status.get("control_bytes")}

    def exported_metrics(self) -> str:
        """Rank 0's metrics page (the group's engine series)."""
        return self.status.get("metrics", "")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        if self.failure or not self._accepting:
            raise EngineUnavailable(f"model {self.name!r} is {'restarting' if self.failure else 'shutting down'}")
        queue: asyncio.Queue = asyncio.Queue()
        if not self._streams:  # an idle group finished no step for a while, rightly: time it from now
            self._progress = time.monotonic()
        self._streams[request.request_id] = queue
        self._send(("submit", request))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finish_reason is not None or out.error is not None
                yield out
        finally:
            self._streams.pop(request.request_id, None)
            if not finished and not self.failure:
                self._send(("cancel", request.request_id))

    async def shutdown(self, grace: float = 30.0) -> None:
        """Let in-flight requests finish within ``grace`` (``drain_within``), then stop every rank."""
        self._accepting = False
        await drain_within(lambda: bool(self._streams) and not self.failure, grace)
        self._stopping = True
        self._send(("stop",))
        await asyncio.to_thread(_reap, self.procs, 10.0)
        for task in self._tasks:
            task.cancel()
        self._writer.close()

    def _send(self, message) -> None:
        if not self._writer.is_closing():
            self._writer.write(wire.encode(message))

    async def _read(self) -> None:
        try:
            while True:
                message = await wire.read_message(self._reader)
                kind = message[0]
                if kind == "out":
                    self._progress = time.monotonic()
                    queue = self._streams.get(message[1])
                    if queue is not None:
                        queue.put_nowait(message[2])
                elif kind == "rejected":
                    queue = self._streams.get(message[1])
                    if queue is not None:
                        queue.put_nowait(_REJECTIONS.get(message[2], RuntimeError)(message[3]))
                elif kind == "status":
                    if message[1]["steps"] != self.status.get("steps"):
                        self._progress = time.monotonic()
                    self.status = message[1]
                elif kind == "fatal":
                    self._fatal = message[1]
                    await self._settle()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self._stopping:
                await self._settle()

    async def _settle(self) -> None:
        """Fail the group naming the rank that went first.  When one rank dies the
        others lose a peer and exit too, and any of them may be the one the daemon
        notices first, so collect the ranks' exits (up to ``EXIT_GRACE``) before judging."""
        if self._settling or self.failure is not None:
            return  # another task is already settling this failure
        self._settling = True
        deadline = time.monotonic() + EXIT_GRACE
        while not self._stopping and not self._settled() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if not self._stopping:
            self.fail(self._fatal_reason())

    def _settled(self) -> bool:
        """Enough is known to name the cause: a rank was killed by a signal (never a
        reaction to a peer's failure), or every rank is gone."""
        self._poll_exits()
        return len(self._exits) == len(self.procs) or any(code < 0 for _, code in self._exits.values())

    def _poll_exits(self) -> None:
        now = time.monotonic()
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and rank not in self._exits:
                self._exits[rank] = (now, code)

    def _culprit(self) -> int | None:
        """The exited rank that brought the group down: one killed by a signal; else
        rank 0 if it reported an error of its own; else the first seen to exit,
        passing over a rank 0 that only reported losing a peer (None: no exit to name)."""
        killed = [r for r, (_, code) in self._exits.items() if code < 0]
        if killed:
            return self._first(killed)
        if self._fatal is None:
            return self._first(list(self._exits))
        if not any(marker in self._fatal for marker in PEER_LOST):
            return 0 if 0 in self._exits else None
        return self._first([r for r in self._exits if r != 0])

    def _first(self, ranks: list[int]) -> int | None:
        """Of these exited ranks, the one seen gone first (the lowest on a tie)."""
        return min(ranks, key=lambda r: (self._exits[r][0], r), default=None)

    def _fatal_reason(self) -> str:
        """The failure as users read it: the culprit's exit, with rank 0's error if it sent one."""
        culprit = self._culprit()
        if culprit is None:
            return (f"rank 0 stopped the group: {self._fatal}" if self._fatal is not None
                    else "rank 0 closed its connection to the daemon")
        exited = self._exit_reason(culprit)
        return f"{exited} (rank 0: {self._fatal})" if self._fatal is not None else exited

    async def _watch(self) -> None:
        """A rank that exits, or a step that never finishes, fails the group."""
        timeout = self.topology.step_timeout_seconds
        while not self._stopping and not self.failure and not self._settling:
            await asyncio.sleep(0.2)
            if self._stopping or self._settling:
                return
            self._poll_exits()
            if self._exits:
                await self._settle()
            elif self._streams and time.monotonic() - self._progress > timeout:
                self.fail(f"no engine step finished in {timeout:g}s with {len(self._streams)} requests "
                          "in flight: a rank is hung or its link is down")

    def _exit_reason(self, rank: int) -> str:
        code = self._exits[rank][1]
        return f"rank {rank} ({self.topology.hosts[rank].name}) exited with {_how(code)}"

    def fail(self, reason: str) -> None:
        """End every request with the reason, kill the ranks, tell the reconciler."""
        if self.failure is not None:
            return
        self.failure = reason
        log.error("tensor-parallel group failed", model=self.name, reason=reason)
        for queue in self._streams.values():
            queue.put_nowait(StepOutput(text="", tokens=[], logprobs=None,
                                        error=f"model {self.name!r}: {reason}"))
        _kill(self.procs)
        self._writer.close()
        self.on_failure()


def with_engine_metrics(registry, engines: list[ServingEngine]):
    """The daemon's metric families with the series engines keep elsewhere
    (a group's rank 0, labelled with its model) merged in, for one
    ``/metrics`` page: a series both report (a failure counter the daemon
    started at 0) is the engine's."""
    families = {f.name: f for f in registry.collect()}
    for engine in engines:
        text = engine.exported_metrics()
        if not text:
            continue
        for family in text_string_to_metric_families(text):
            # ``_created`` companions come back as families of their own: leave them out
            mine = [s for s in family.samples
                    if s.labels.get("model_name") == engine.name and not s.name.endswith("_created")]
            if not mine:
                continue
            ours = families.setdefault(family.name, family)
            if ours is not family:
                keys = {(s.name, tuple(sorted(s.labels.items()))) for s in mine}
                ours.samples = [s for s in ours.samples
                                if (s.name, tuple(sorted(s.labels.items()))) not in keys] + mine
            else:
                family.samples = mine
    return SimpleNamespace(collect=lambda: list(families.values()))


def _how(code: int) -> str:
    """A return code as words: ``signal SIGKILL`` or ``exit code 1``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill the ranks here, and close their stdin: a rank started over ssh sees it end and leaves."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.stdin is not None:
            proc.stdin.close()


def _reap(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(procs)


async def start_group(name: str, spec: ModelSpec, topology: TopologySpec, on_failure: Callable[[], None],
                      speculation: SpeculationConfig = NO_SPECULATION,
                      draft_source: str | None = None, ready_timeout: float = 900.0) -> GroupClient:
    """Start every rank, wait for rank 0 to report the group loaded."""
    check_placement(topology)
    tokenizer = await asyncio.to_thread(load_tokenizer, spec.source, spec.revision)
    hello: asyncio.Future = asyncio.get_running_loop().create_future()
    token = secrets.token_hex(16)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            message = await asyncio.wait_for(wire.read_message(reader), 10)
        except Exception:
            writer.close()
            return
        if message[0] == "hello" and message[1] == token and not hello.done():
            hello.set_result((message[2], reader, writer))
            return
        if message[0] == "failed" and message[1] == token and not hello.done():
            hello.set_exception(RuntimeError(f"rank 0 ({topology.hosts[0].name}) could not load: {message[2]}"))
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    control = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    plan = GroupPlan(name, spec.source, topology.backend, topology.tensor_parallel_size,
                     mlx_environment(topology, group_ports(topology)), control, token, engine_fields(spec),
                     asdict(speculation) if speculation.enabled else None, draft_source, spec.revision,
                     topology.parallelism)
    procs = []
    for rank in range(topology.tensor_parallel_size):
        cmd, env = rank_command(topology, rank, plan)
        # the daemon holds each rank's stdin open and never writes to it: when the daemon is gone,
        # killed mid-start too, the rank (or ssh, for it) reads the end of it and the rank leaves
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, start_new_session=True))
    log.info("group starting", model=name, backend=topology.backend, parallelism=topology.parallelism,
             ranks=[p.pid for p in procs])
    try:
        deadline = time.monotonic() + ready_timeout
        while not hello.done():
            exited = next(((rank, p) for rank, p in enumerate(procs) if p.poll() is not None), None)
            if exited is not None:
                await asyncio.wait([hello], timeout=EXIT_GRACE)  # rank 0's reason may be on its way
                if hello.done():
                    break
                rank, proc = exited
                raise RuntimeError(f"rank {rank} ({topology.hosts[rank].name}) exited with code "
                                   f"{proc.returncode} while the group was starting (see the daemon log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the group did not load within {ready_timeout:g}s")
            await asyncio.wait([hello], timeout=0.2)
        info, reader, writer = hello.result()
    except BaseException:
        _kill(procs)
        raise
    finally:
        server.close()
        if not hello.done():  # a rank's late word finds nobody waiting, and is dropped
            hello.cancel()
    return GroupClient(name, topology, procs, tokenizer, info, speculation, on_failure, reader, writer)
