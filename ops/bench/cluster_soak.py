#!/usr/bin/env python3
"""Cluster soak: an hour of steady traffic through a head with two workers on loopback, while the
cluster is disturbed as a shelf of Macs is.

A head (no room of its own: it places, tokenizes and routes) and two worker daemons, joined over
TLS with the head's join token. ``soak.Soak``'s clients send their mix through the head (chat,
streams, completions, ``n = 2``, JSON schema output, n-gram, disconnects, invalid requests) to the
demo model with ``replicas: 2``, and its control loop swaps the SpecPolicy every 30 s and edits the
Model every 5 minutes. On top, every ``--freeze-every`` minutes one worker (in turn) is frozen
(SIGSTOP) for ``--freeze-seconds``, a Mac asleep; and every ``--zero-every`` minutes the Model goes
to ``minReplicas: 0`` with a short idle time for a while, so replicas unload and wake.

Expected answers: those ``soak.py`` expects, and a 500 or 503 that names a Node or a replica that
cannot serve (a request a frozen Node held, or one sent while no replica was ready): the client
sees each fail. Anything else, or a request that took longer than ``--bound`` seconds, is
unexpected. Every 10 s it samples each daemon's RSS and threads and the processes under it.

Every ``--rest-every`` minutes (between freezes) the clients pause for ``--rest-seconds`` and each
daemon's RSS is read at rest, the same state each time; and in each scale-to-zero spell the clients
pause until no replica is loaded, and each daemon's RSS is read unloaded (no weights, KV or caches).

Reports, per daemon: RSS at rest and unloaded over the hour (slopes across those spells, MB per minute),
RSS growth under load (the last five minutes' median and peak against minutes 2 to 7, and at rest
after the load), threads and child processes at the start and end; the outcomes;
and whether the desired state equals the observed at the end (the Model Ready with both replicas
on the two workers, each Node Ready).

Usage (from the repository root)::

    python ops/bench/cluster_soak.py --minutes 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp

import serve_vs_mlx_lm as anchor
from soak import ADMIN, MODEL, Soak, manifest, rss
from spec_decode import write_result

DEFAULT_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "cluster_soak.json"
TOKEN = "cluster-soak-secret"
JOIN_TIMEOUT_S = 120.0  # how long the head may take to start and both workers to join it Ready
LOAD_TIMEOUT_S = 600.0  # how long the Model may take to be Ready on both workers before the soak gives up


async def wait_for(check: Callable[[], Awaitable[tuple[bool, Any]]], seconds: float, what: str) -> None:
    """Poll ``check`` (done, and what it saw) until done; after ``seconds`` give up, naming what it
    last saw, rather than hang the soak on a daemon that never comes up."""
    until = time.monotonic() + seconds
    while not (seen := await check())[0]:
        if time.monotonic() > until:
            raise SystemExit(f"{what} after {seconds:.0f}s: {seen[1]}")
        await asyncio.sleep(0.5)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def descendants(pid: int) -> int:
    """Processes under ``pid`` (rank processes, anything a daemon started and left)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    seen, todo = 0, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            seen += 1
            todo.append(child)
    return seen


class ClusterSoak(Soak):
    """``Soak`` through a head, with Node faults among the expected answers."""

    def __init__(self, *args, bound: float, scale_to_zero: list[bool], **kwargs):
        super().__init__(*args, **kwargs)
        self.bound, self.scale_to_zero = bound, scale_to_zero
        self.zero_spells = 0  # scale-to-zero spells begun

    def record(self, kind: str, status: int, expected: set[int], detail: str = "") -> None:
        node_fault = status in (500, 503) and any(w in detail for w in ("Node", "replica", "not ready", "loading"))
        super().record(kind, status, expected | ({status} if node_fault else set()), detail)

    async def apply(self, session: aiohttp.ClientSession, max_waiting: int, k: int) -> None:
        body = manifest(max_waiting, k, self.prefix_cache_bytes, self.disk_bytes)
        spec = body["items"][0]["spec"]
        spec.update(source=self.source, replicas=2)
        if self.scale_to_zero[0]:
            spec["scaling"] = {"minReplicas": 0, "idleSeconds": 20}
        async with session.post(self.base + ADMIN + "/apply", json=body) as r:
            self.record("apply", r.status, {200}, await r.text())


async def disturb(soak: ClusterSoak, session: aiohttp.ClientSession, workers: list[subprocess.Popen],
                  args, events: list[dict[str, Any]]) -> None:
    """Freeze a worker now and then; scale the Model to zero for a while now and then."""
    next_freeze = time.monotonic() + args.freeze_every * 60
    next_zero = time.monotonic() + args.zero_every * 60
    turn = 0
    while time.monotonic() < soak.deadline - args.freeze_seconds - 30:
        await asyncio.sleep(1)
        if soak.resting:  # nothing changes during a rest spell: what follows it waits
            continue
        if time.monotonic() >= next_freeze:
            proc = workers[turn % len(workers)]
            events.append({"t_s": round(time.monotonic() - soak.started), "freeze": turn % len(workers)})
            proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(args.freeze_seconds)
            finally:
                proc.send_signal(signal.SIGCONT)
            turn += 1
            next_freeze += args.freeze_every * 60
        if time.monotonic() >= next_zero:
            soak.scale_to_zero[0] = not soak.scale_to_zero[0]
            soak.zero_spells += soak.scale_to_zero[0]
            events.append({"t_s": round(time.monotonic() - soak.started), "scale_to_zero": soak.scale_to_zero[0]})
            await soak.apply(session, 64, 2)
            next_zero += (args.zero_every if soak.scale_to_zero[0] is False else 2) * 60


async def rest_spells(soak: ClusterSoak, daemons: dict[str, int], args, rests: list[dict[str, Any]],
                      unloaded: list[dict[str, Any]], replicas: Callable[[], Awaitable[int]]) -> None:
    """Every ``--rest-every`` minutes (half a period off the freezes), once no worker is frozen
    and the Model is not at zero: ``--rest-seconds`` without requests, then each daemon's RSS.
    Readings at rest, the same state each time, tell memory that accumulates from the working
    sets of requests in flight. And once in each scale-to-zero spell (no worker frozen): no
    requests until no replica is loaded anywhere, then each daemon's RSS (``unloaded``): with the
    weights, KV and prefix caches gone, what is left is the daemon's own, so readings that rise
    from spell to spell are a leak, not a cache filling."""
    next_rest = soak.started + args.rest_every * 30
    zero_spells_read = 0
    while time.monotonic() < soak.deadline - args.rest_seconds - 30:
        await asyncio.sleep(1)
        frozen = any(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("T") for pid in daemons.values())
        if frozen:
            continue
        if soak.scale_to_zero[0] and zero_spells_read < soak.zero_spells:
            zero_spells_read = soak.zero_spells
            soak.resting = True
            try:
                waited = time.monotonic()
                while await replicas() and time.monotonic() - waited < 120:
                    await asyncio.sleep(1)
                if not await replicas():
                    await asyncio.sleep(5)  # the unload's own frees
                    unloaded.append({"t_s": round(time.monotonic() - soak.started),
                                     "waited_s": round(time.monotonic() - waited),
                                     **{n: rss(pid) for n, pid in daemons.items()}})
            finally:
                soak.resting = False
            continue
        if time.monotonic() < next_rest or soak.scale_to_zero[0]:
            continue
        soak.resting = True
        try:
            await asyncio.sleep(args.rest_seconds)
            rests.append({"t_s": round(time.monotonic() - soak.started),
                          **{n: rss(pid) for n, pid in daemons.items()}})
        finally:
            soak.resting = False
        next_rest += args.rest_every * 60


def rest_slope(rests: list[dict[str, Any]], name: str) -> float | None:
    """MB per minute of a daemon's RSS at rest, fitted over the rest spells (least squares)."""
    if len(rests) < 2:
        return None
    minutes = [r["t_s"] / 60 for r in rests]
    megabytes = [r[name] / 1e6 for r in rests]
    return round(statistics.linear_regression(minutes, megabytes).slope, 3)


async def observe(session: aiohttp.ClientSession, head: str, daemons: dict[str, int], soak: ClusterSoak,
                  samples: list[dict[str, Any]]) -> None:
    while True:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - soak.started, 1)}
        for name, pid in daemons.items():
            try:
                row[name] = {"rss_bytes": rss(pid), "threads": threads(pid), "processes": descendants(pid)}
            except OSError:
                row[name] = None
        samples.append(row)
        if time.monotonic() >= soak.deadline:
            return
        await asyncio.sleep(10)


def growth(samples: list[dict[str, Any]], name: str, statistic) -> float:
    end = samples[-1]["t_s"]
    late = [s[name]["rss_bytes"] for s in samples if s.get(name) and s["t_s"] >= end - 300]
    early = [s[name]["rss_bytes"] for s in samples if s.get(name) and 120 <= s["t_s"] < 420]
    return statistic(late) / statistic(early) - 1 if late and early else float("nan")


async def run(args, env: dict, workdir: Path) -> dict[str, Any]:
    (workdir / "secret").write_text(TOKEN)
    ports = {n: (anchor.free_port(), anchor.free_port()) for n in ("head", "w1", "w2")}
    daemons: dict[str, subprocess.Popen] = {}
    logs = {n: (workdir / f"{n}.log").open("wb") for n in ports}

    def start(name: str, *extra: str) -> subprocess.Popen:
        port, cluster_port = ports[name]
        return subprocess.Popen([sys.executable, "-m", "specd.cli", "daemon", "--state-dir", str(workdir / name),
                                 "--host", "127.0.0.1", "--port", str(port), "--cluster-port", str(cluster_port),
                                 "--node-name", name, *extra], env=env, cwd=anchor.REPO_ROOT, stdout=logs[name],
                                stderr=subprocess.STDOUT, start_new_session=True)
    head = f"http://127.0.0.1:{ports['head'][0]}"
    timeout = aiohttp.ClientTimeout(total=args.bound)
    rests: list[dict[str, Any]] = []
    unloaded: list[dict[str, Any]] = []
    try:
        daemons["head"] = start("head", "--cluster-token-file", str(workdir / "secret"), "--memory-limit", "1Mi")
        join_token = workdir / "head" / "cluster-join-token"

        async def token_written() -> tuple[bool, Any]:
            return join_token.exists(), f"its exit status {daemons['head'].poll()} (None: running), see {workdir / 'head.log'}"
        await wait_for(token_written, JOIN_TIMEOUT_S, "the head wrote no join token")
        for name in ("w1", "w2"):
            daemons[name] = start(name, "--join", f"https://127.0.0.1:{ports['head'][1]}", "--token-file",
                                  str(join_token), "--memory-limit", "4Gi")
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            soak = ClusterSoak(head, str(Path(args.model).resolve()), daemons["head"].pid, args.minutes,
                               args.prefix_cache_bytes, bound=args.bound, scale_to_zero=[False])

            async def status() -> dict[str, Any]:
                async with session.get(head + ADMIN + f"/models/{MODEL}") as r:
                    return (await r.json()).get("status", {}) if r.status == 200 else {}

            async def loaded_replicas() -> int:  # a replica scaled to zero stays placed, Idle
                return sum(r["phase"] in ("Loading", "Ready") for r in (await status()).get("replicas") or [])

            async def nodes_ready() -> dict[str, bool]:
                async with session.get(head + ADMIN + "/nodes") as r:
                    items = (await r.json())["items"]
                return {n["metadata"]["name"]: n["status"]["conditions"][0]["status"] == "True" for n in items}

            async def workers_joined() -> tuple[bool, Any]:
                try:
                    ready = await nodes_ready()
                except (aiohttp.ClientError, KeyError):
                    ready = {}  # the head is still starting
                exited = {n: code for n in ("w1", "w2") if (code := daemons[n].poll()) is not None}
                return ready.get("w1", False) and ready.get("w2", False), f"Ready {ready}, exited {exited}"

            async def model_ready() -> tuple[bool, Any]:  # a source that is not there fails every read
                current = await status()
                return current.get("readyReplicas") == 2, current.get("conditions")
            await wait_for(workers_joined, JOIN_TIMEOUT_S, "the two workers are not Ready")
            await soak.apply(session, 64, 2)
            await wait_for(model_ready, LOAD_TIMEOUT_S, "the Model has no two ready replicas")
            soak.deadline = time.monotonic() + args.minutes * 60
            soak.started = time.monotonic()
            samples: list[dict[str, Any]] = []
            events: list[dict[str, Any]] = []
            pids = {n: p.pid for n, p in daemons.items()}
            await asyncio.gather(observe(session, head, pids, soak, samples), soak.control(session),
                                 rest_spells(soak, pids, args, rests, unloaded, loaded_replicas),
                                 disturb(soak, session, [daemons["w1"], daemons["w2"]], args, events),
                                 *(soak.client(session, seed) for seed in range(args.clients)))
            soak.scale_to_zero[0] = False
            await soak.apply(session, 64, 2)
            settle = time.monotonic()
            while time.monotonic() - settle < 120:
                final, ready = await status(), await nodes_ready()
                if final.get("readyReplicas") == 2 and all(ready.values()):
                    break
                await asyncio.sleep(1)
            converged_s = time.monotonic() - settle
            await asyncio.sleep(30)  # at rest: what each daemon holds without load
            rest = {n: {"rss_bytes": rss(p), "threads": threads(p), "processes": descendants(p)} for n, p in pids.items()}
    finally:
        for proc in daemons.values():
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        for proc in daemons.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    first = next((s for s in samples if s["t_s"] >= 120), samples[0])
    per_daemon = {n: {"rss_at_rest_mb_per_minute": rest_slope(rests, n),
                      "rss_unloaded_mb_per_minute": rest_slope(unloaded, n),
                      "rss_median_growth": growth(samples, n, statistics.median),
                      "rss_peak_growth": growth(samples, n, max),
                      "rss_at_minute_2": first[n]["rss_bytes"], "rss_at_rest": rest[n]["rss_bytes"],
                      "threads_at_minute_2": first[n]["threads"], "threads_at_rest": rest[n]["threads"],
                      "processes_at_minute_2": first[n]["processes"], "processes_at_rest": rest[n]["processes"]}
                  for n in pids}
    replicas = sorted(r["node"] for r in final.get("replicas", []))
    return {"unexpected_errors": len(soak.unexpected), "unexpected_examples": soak.unexpected[:20],
            "outcomes": {f"{k} {s}": n for (k, s), n in sorted(soak.outcomes.items())},
            "requests": sum(soak.outcomes.values()), "disturbances": events, "daemons": per_daemon,
            "desired_equals_observed": final.get("readyReplicas") == 2 and replicas == ["w1", "w2"]
            and all(ready.values()),
            "rests": rests, "unloaded_rests": unloaded, "final_replicas": replicas, "final_nodes_ready": ready,
            "converged_s": round(converged_s, 1),
            "samples": samples, "head_log_tail": anchor.log_tail(workdir / "head.log", 20)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(anchor.REPO_ROOT / "models" / "demo" / "target"))
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefix-cache-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--freeze-every", type=float, default=10.0, help="minutes between frozen workers")
    parser.add_argument("--freeze-seconds", type=float, default=30.0)
    parser.add_argument("--zero-every", type=float, default=7.0, help="minutes between scale-to-zero spells")
    parser.add_argument("--rest-every", type=float, default=10.0, help="minutes between rest spells")
    parser.add_argument("--rest-seconds", type=float, default=45.0, help="how long a rest spell lasts")
    parser.add_argument("--bound", type=float, default=120.0, help="seconds any request may take")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    env, _ = anchor.child_env()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args, env, Path(tmp)))
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "head_log_tail")}, indent=2,
                     default=str))
    write_result(args.out, {"minutes": args.minutes, "clients": args.clients, "model": args.model,
                            "host": anchor.host_info(), **result})
    return 0 if result["unexpected_errors"] == 0 and result["desired_equals_observed"] else 1


if __name__ == "__main__":
    sys.exit(main())
