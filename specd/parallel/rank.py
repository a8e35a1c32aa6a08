"""A rank of a tensor- or pipeline-parallel group: ``specd rank`` (started by the daemon).

Every rank holds a shard of the target (``mlx_lm``'s ``model.shard``, or a slice
of its layers under pipeline parallelism, ``pipeline.py``; ``shard.py`` loads
it, and for ``parallelism: auto`` times both first), a full copy of the
draft model if there is one, and the same ``Engine``.  Rank 0
takes requests from the daemon; before every step it broadcasts what changed
(arrivals with their RNG keys, cancellations, policy swaps, stop) through
``mx.distributed``, so every rank steps the same batch.  Everything after that
is deterministic given the all-reduced (or gathered) logits — n-gram proposals, the
replicated draft, sampling and rejection sampling from each request's own key
— except the controller's choice of k and how many forced tokens a step
verifies, both made from timed costs: rank 0's choices are broadcast too.  A
digest of every rank's batch rides along in each step's header, so ranks that
drift apart stop the group instead of serving wrong tokens.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import structlog
from prometheus_client import generate_latest

from ..core import cpu_jit, layout
from ..core.loader import load_model, weight_bytes
from ..core.memory import reuse_freed_memory
from ..core.sequence import Sequence
from ..engine.engine import Engine
from ..engine.scheduler import EngineConfig, StepInputs
from ..metrics import Metrics
from ..core.request import Method, NO_SPECULATION, SpeculationConfig
from ..speculation.config import PolicySettings
from .shard import load_shard
from . import wire
from .topology import GroupPlan

log = structlog.get_logger(__name__)
_STOP = -1


@dataclass(frozen=True)
class PolicyUpdate:
    """A SpecPolicy swap as data, queued where a local engine queues a closure:
    rank 0 broadcasts it and every rank applies it before the same step."""

    policy: object
    name: str | None


class RanksDiverged(RuntimeError):
    pass


class GroupRank:
    """Steps an engine's scheduler in lockstep with every rank of ``group``.

    Every rank holds an ``Engine`` (never started: this class runs its
    steps); rank 0's inbox takes the daemon's requests, and what arrives
    there is broadcast so that every rank's scheduler takes the same inputs.
    """

    def __init__(self, engine: Engine, group: mx.distributed.Group):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.group = group
        self.rank = group.rank()
        self.steps = 0
        self.bytes_sent = 0  # control traffic (headers, payloads, agreed choices)
        self.scheduler.speculator.agree = self._agree

    def set_policy(self, policy: PolicySettings | None, name: str | None) -> None:
        self.engine.inbox.between_steps(PolicyUpdate(policy, name))

    def run_steps(self) -> None:
        """Step in lockstep with the group until rank 0 says stop (every rank runs this).

        A failed step may have left the ranks apart, so it stops the whole
        group (the daemon fails its requests, naming the rank that went away)."""
        while (inputs := self._next_inputs()) is not None:
            try:
                self.scheduler.step(inputs)
            except Exception:
                log.exception("group step failed", model=self.engine.name, rank=self.rank)
                raise
        self.scheduler.fail_all("engine stopped", self.engine.inbox.drain())

    def _next_inputs(self) -> StepInputs | None:
        payload = b""
        if self.rank == 0:
            local = self.engine.inbox.take(self.scheduler.busy)
            if local is None:
                payload = None
            elif local.arrivals or local.cancelled or local.updates:
                payload = pickle.dumps((
                    [(s.request, np.array(s.key).tolist()) for s in local.arrivals],
                    sorted(local.cancelled),
                    [(u.policy, u.name) for u in local.updates]))
        message = self._exchange(payload)
        self.steps += 1
        if message is None:
            return None
        if not message:
            return StepInputs()
        arrivals, cancelled, policies = pickle.loads(message)
        if self.rank == 0:
            seqs = local.arrivals
        else:
            seqs = [self._follower_sequence(request, key) for request, key in arrivals]
        speculator = self.scheduler.speculator
        updates = [lambda p=p, n=n: speculator.feedback.set_policy(p, n) for p, n in policies]
        return StepInputs(seqs, set(cancelled), updates)

    def _follower_sequence(self, request, key: list[int]) -> Sequence:
        seq = self.scheduler.sequence(request, emit=lambda out: None)
        seq.key = mx.array(key, dtype=mx.uint32)
        return seq

    def _exchange(self, payload: bytes | None) -> bytes | None:
        """Rank 0's payload to every rank (None: stop), with every rank's batch digest checked."""
        size = self.group.size()
        header = np.zeros(1 + size, np.int32)
        header[1 + self.rank] = self._digest()
        if self.rank == 0:
            header[0] = _STOP if payload is None else len(payload)
        summed = mx.distributed.all_sum(mx.array(header), group=self.group).tolist()
        self.bytes_sent += header.nbytes
        digests = summed[1:]
        if len(set(digests)) > 1:
            raise RanksDiverged(f"ranks disagree about the batch (digests {digests})")
        length = summed[0]
        if length == _STOP:
            return None
        if length == 0:
            return b""
        buf = np.frombuffer(payload, np.uint8) if self.rank == 0 else np.zeros(length, np.uint8)
        out = mx.distributed.all_sum(mx.array(buf), group=self.group)
        self.bytes_sent += length
        return bytes(np.array(out))

    def _agree(self, choices: list[int]) -> list[int]:
        """Rank 0's choices, on every rank."""
        mine = np.array(choices if self.rank == 0 else [0] * len(choices), np.int32)
        self.bytes_sent += mine.nbytes
        return mx.distributed.all_sum(mx.array(mine), group=self.group).tolist()

    def _digest(self) -> int:
        state = [(len(s.tokens), s.tokens[-1:]) for s in self.scheduler.batch.seqs]
        return zlib.crc32(repr(state).encode()) & 0x7FFFFFFF


SCRATCH_PREFIX = "specd-rank-"  # + the rank's pid + "-": where it writes the files MLX reads as it joins


def _join_group(plan: GroupPlan) -> mx.distributed.Group:
    """Write the files this rank's MLX reads (its hostfile, its devices), then init the
    backend; MLX reads them while it joins, so they are gone once it has."""
    env = dict(plan.env)
    _remove_scratch_of_dead_ranks()
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as scratch:
        for inline, var in (("SPECD_MLX_HOSTFILE", "MLX_HOSTFILE"), ("SPECD_MLX_IBV_DEVICES", "MLX_IBV_DEVICES")):
            if inline in env:
                path = Path(scratch) / var.lower()
                path.write_text(env.pop(inline))
                env[var] = str(path)
        os.environ.update(env)
        return mx.distributed.init(backend=plan.backend, strict=True)


def _remove_scratch_of_dead_ranks() -> None:
    """A rank killed as it joined (the daemon gone, ``kill -9``) leaves its scratch directory
    behind: the next rank on this host removes those whose process is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


# Reads stdin to its end, then kills its parent (the rank) if that still is its parent.
_LIFELINE = ("import os, signal, sys\n"
             "while os.read(0, 4096):\n    pass\n"
             "if os.getppid() == int(sys.argv[1]):\n    os.kill(int(sys.argv[1]), signal.SIGKILL)\n")


def _leave_with_the_daemon() -> None:
    """The daemon holds this process's stdin open (through ssh for a remote rank) and never
    writes to it: its end means the daemon is gone, so the rank is killed, whatever it was
    doing. The watcher is a small process of its own, not a thread: a rank waiting in the
    group's join (``mx.distributed.init``) holds the GIL, so no thread of its own could run
    (and a process started afresh, not forked, is safe beside Metal on macOS)."""
    subprocess.Popen([sys.executable, "-c", _LIFELINE, str(os.getpid())])


def run(plan: GroupPlan) -> int:
    _leave_with_the_daemon()
    reuse_freed_memory()
    cpu_jit.install()  # its PATH and TMPDIR set before the stepping thread starts
    # A rank's rows keep a buffer each: every rank would time the layouts on its own and could take
    # another, and mlx-lm's own pipeline hand-off reads a layer's per-row buffers (``cache.keys``).
    layout.LAYOUT = "rows"
    group = _join_group(plan)
    rank = group.rank()
    structlog.contextvars.bind_contextvars(model=plan.model, rank=rank)
    started = time.monotonic()
    try:
        model, tokenizer, split = load_shard(plan.source, plan.revision, group, plan.parallelism, plan.backend)
        draft = load_model(plan.draft_source)[0] if plan.draft_source else None
        speculation = (SpeculationConfig(**{**plan.speculation, "method": Method(plan.speculation["method"])})
                       if plan.speculation else NO_SPECULATION)
        engine = Engine(plan.model, model, tokenizer, EngineConfig(**plan.engine), Metrics(), speculation, draft)
    except Exception as exc:
        if rank == 0:
            _report_failed_load(plan, f"{type(exc).__name__}: {exc}")
        raise
    stepper = GroupRank(engine, group)
    local = weight_bytes(model)
    total = int(mx.distributed.all_sum(mx.array([local], dtype=mx.int64), group=group).item())
    log.info("rank ready", seconds=round(time.monotonic() - started, 2), shard_bytes=local)
    if rank != 0:
        stepper.run_steps()
        _exit(0)
    return _serve(stepper, plan, {"weight_bytes": total, "max_context": engine.max_context,
                                 "vocab_size": engine.vocab_size, "drafter": engine.drafter, **split.as_dict()})


def _control_connection(plan: GroupPlan, timeout: float | None = None) -> socket.socket:
    """Rank 0's connection to the daemon that started it (``plan.control``, on loopback)."""
    host, port = plan.control.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _report_failed_load(plan: GroupPlan, reason: str) -> None:
    """Rank 0 could not load its part: tell the daemon why, so the Model's status says it (the
    other ranks' reasons are in their own logs)."""
    try:
        with _control_connection(plan, timeout=5) as sock:
            sock.sendall(wire.encode(("failed", plan.token, reason)))
    except OSError:  # the daemon is gone or stopped waiting: the exit code is all it gets
        pass


def _serve(stepper: GroupRank, plan: GroupPlan, info: dict) -> int:
    """Rank 0: requests in from the daemon, outputs and status back."""
    engine = stepper.engine
    sock = _control_connection(plan)
    sending = threading.Lock()

    def send(message) -> None:
        frame = wire.encode(message)
        with sending:
            sock.sendall(frame)

    def step_thread() -> None:
        try:
            stepper.run_steps()
        except Exception as exc:  # the group cannot go on; the daemon restarts it
            try:
                send(("fatal", f"{type(exc).__name__}: {exc}"))
            finally:
                _exit(1)

    def report() -> None:
        while True:
            time.sleep(0.5)
            send(("status", {"steps": stepper.steps, "in_flight": engine.in_flight,
                             "control_bytes": stepper.bytes_sent, "speculation": _status(engine),
                             "prefixCache": engine.prefix_cache_status(), "kvCache": engine.kv_cache_status(),
                             "metrics": generate_latest(engine.metrics.registry).decode()}))

    send(("hello", plan.token, info))
    stepping = threading.Thread(target=step_thread, name="group-engine", daemon=True)
    stepping.start()
    threading.Thread(target=report, name="group-status", daemon=True).start()
    while True:
        try:
            message = wire.recv_message(sock)
        except (EOFError, OSError):
            break  # the daemon is gone: stop the group
        kind = message[0]
        if kind == "submit":
            request = message[1]
            try:
                engine.submit(request, lambda out, rid=request.request_id: send(("out", rid, out)))
            except Exception as exc:
                send(("rejected", request.request_id, type(exc).__name__, str(exc)))
        elif kind == "cancel":
            engine.cancel(message[1])
        elif kind == "policy":
            stepper.set_policy(message[1], message[2])
        elif kind == "stop":
            break
    engine.stop()
    stepping.join(30)
    _exit(0)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown, as the daemon does (see
    ``cli._daemon``): MLX 0.32 can abort in its static destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _status(engine: Engine) -> dict:
    try:
        return engine.speculation_status()
    except RuntimeError:  # a dict changed size under us: report next time
        return {}
