#!/usr/bin/env python3
"""Control churn: a stream's inter-token gaps while the control plane is idle, and while it churns.

A real daemon (``specd daemon``, started by this script on a free port of
127.0.0.1) serves the demo target as ``stream``.  Each *run*:

1. opens one long greedy streaming chat completion on ``stream`` (``max_tokens``
   enough to outlast the run; should the model end it early, another is opened
   at once, and no gap spans two streams);
2. records the arrival time of every SSE chunk of that stream;
3. for ``--idle-seconds`` nothing else happens (the *idle* window);
4. then ``--models`` Model manifests are applied through the admin API, one per
   ``POST /apis/specd.dev/v1alpha1/apply``, from ``--clients`` clients: each is
   created (``scaling.minReplicas: 0`` of the same checkpoint, so it never
   loads), then, ``--updates`` times, changed (a label, an annotation and
   ``scaling.idleSeconds``, so its generation moves and its reconciler writes a
   new status); the *churn* window lasts from the first apply until every one
   of these Models reports ``status.observedGeneration`` equal to its
   generation (its reconcile written);
5. then, for ``--busy-seconds``, a process outside the daemon (no GIL, no
   control-plane work, no request) spins one core (the *busy* window): what
   sharing the machine's cores alone costs the stream, for reference;
6. the stream is closed and the churn Models deleted (not measured), and the
   daemon left quiet for ``--quiet-seconds``.

The gaps between consecutive chunks arriving in each window give p50 and p99,
and the figure the issue sets a goal for is ``p99_churn / p99_idle`` (goal:
within 1.5x); ``p99_busy / p99_idle`` is printed beside it.  Figures are
medians over ``--runs`` runs.  The machine is shared: the CPU cores other
processes used during the idle and churn windows (from /proc, as
``serve_vs_mlx_lm.py`` measures them) are recorded next to each.

Usage (from the repository root, after ``source ops/env.sh``)::

    python ops/bench/control_churn.py --runs 5
    python ops/bench/control_churn.py --runs 5 --baseline other-commit.json  # that summary beside this one
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from serve_vs_mlx_lm import (ForeignLoad, ServerSpec, child_env, forge_info, free_port, host_info, log_tail,
                             package_version, running)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "demo" / "target"
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "control_churn.json"
PREFIX = "/apis/specd.dev/v1alpha1"
API_VERSION = "specd.dev/v1alpha1"
STREAM_MODEL = "stream"
READY_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 300.0
PROMPT = "Write a long Python module: a class with many methods, each with a docstring and tests."


# --------------------------------------------------------------------------
# The daemon and its admin API


def stream_manifest(model: Path) -> str:
    return (f"apiVersion: {API_VERSION}\nkind: Model\nmetadata:\n  name: {STREAM_MODEL}\n"
            f"spec:\n  source: {model}\n  maxBatchSize: 4\n")


def churn_manifest(model: Path, i: int, step: int) -> dict[str, Any]:
    """Churn Model ``i`` at ``step`` (0: created; each later step changes a label, an annotation and the spec)."""
    return {"apiVersion": API_VERSION, "kind": "Model",
            "metadata": {"name": f"churn-{i:03d}", "labels": {"bench": "control-churn", "step": str(step)},
                         "annotations": {"bench.specd.dev/step": str(step)}},
            "spec": {"source": str(model), "scaling": {"minReplicas": 0, "idleSeconds": 900 + step}}}


def call(base: str, method: str, path: str, body: Any = None, timeout: float = 120.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_ready(base: str, proc, log_path: Path) -> float:
    started = time.monotonic()
    while time.monotonic() - started < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}:\n{log_tail(log_path)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base + "/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        time.sleep(0.25)
    raise RuntimeError(f"the daemon was not ready after {READY_TIMEOUT_S:.0f}s:\n{log_tail(log_path)}")


def churn_models(base: str) -> list[dict[str, Any]]:
    return [o for o in call(base, "GET", PREFIX + "/models")["items"] if o["metadata"]["name"].startswith("churn-")]


def wait_settled(base: str, expected: int, poll_s: float = 0.2) -> None:
    """Until ``expected`` churn Models exist and each has the status of its current generation."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        models = churn_models(base)
        if len(models) == expected and all(o.get("status", {}).get("observedGeneration") == o["metadata"]["generation"]
                                           for o in models):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"churn Models never settled ({len(models)} of {expected} present)")
        time.sleep(poll_s)


def churn(base: str, model: Path, models: int, updates: int, clients: int) -> dict[str, Any]:
    """Apply every churn Model, one per request, then change each ``updates`` times; until all settled."""
    applies = []

    def apply_all(step: int) -> None:
        def one(i: int) -> None:
            started = time.monotonic()
            call(base, "POST", PREFIX + "/apply", {"items": [churn_manifest(model, i, step)]})
            applies.append(time.monotonic() - started)

        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(models)))

    started = time.monotonic()
    for step in range(updates + 1):
        apply_all(step)
    applied = time.monotonic()
    wait_settled(base, models)
    return {"applies": len(applies), "apply_s": applied - started, "settle_s": time.monotonic() - applied,
            "apply_latency_ms_p50": statistics.median(applies) * 1000,
            "apply_latency_ms_max": max(applies) * 1000}


def delete_churn(base: str) -> None:
    for o in churn_models(base):
        with contextlib.suppress(urllib.error.HTTPError):
            call(base, "DELETE", f"{PREFIX}/models/{o['metadata']['name']}")
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while churn_models(base):
        if time.monotonic() > deadline:
            raise RuntimeError("churn Models were never deleted")
        time.sleep(0.2)


# --------------------------------------------------------------------------
# The stream


class Stream(threading.Thread):
    """Greedy streaming chat completions back to back until stopped; each chunk's arrival time.

    A thread of its own with blocking reads, so the applies made meanwhile do not
    delay when a chunk is seen arriving."""

    def __init__(self, port: int, max_tokens: int):
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.streams: list[list[float]] = []  # per stream: the monotonic arrival time of each chunk
        self.finish_reasons: list[str | None] = []
        self.first_chunk = threading.Event()
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._one()
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            self.error = err
            self.first_chunk.set()

    def _one(self) -> None:
        body = {"model": STREAM_MODEL, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        times: list[float] = []
        self.streams.append(times)
        finish = None
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            while not self.stopping.is_set():
                line = resp.readline()
                now = time.monotonic()
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if event.get("choices"):
                    times.append(now)
                    self.first_chunk.set()
                    finish = event["choices"][0].get("finish_reason") or finish
        finally:
            conn.close()
            self.finish_reasons.append(finish)

    def gaps(self, start: float, end: float) -> list[float]:
        """Seconds between consecutive chunks of one stream, both arriving within [start, end]."""
        out = []
        for times in list(self.streams):
            out += [b - a for a, b in zip(times, times[1:]) if a >= start and b <= end]
        return out


# --------------------------------------------------------------------------
# Runs and summary


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile, linearly interpolated between the closest ranks (numpy's default)."""
    return float(np.percentile(values, q)) if values else None


def window(gaps: list[float], foreign: float | None, seconds: float) -> dict[str, Any]:
    ms = [g * 1000 for g in gaps]
    return {"seconds": seconds, "gaps": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms) if ms else None, "mean_ms": statistics.fmean(ms) if ms else None,
            "foreign_cores": foreign, "gaps_ms": [round(g, 3) for g in ms]}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def spin_one_core(seconds: float) -> None:
    """A process of its own that keeps one core busy for ``seconds``."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(seconds)
    finally:
        spinner.kill()
        spinner.wait()


def one_run(base: str, port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    stream = Stream(port, args.max_tokens)
    stream.start()
    try:
        if not stream.first_chunk.wait(120) or stream.error is not None:
            raise RuntimeError(f"the stream never started: {stream.error!r}")
        time.sleep(args.lead_seconds)  # past the first chunks
        load = ForeignLoad(pid)
        idle_start = time.monotonic()
        time.sleep(args.idle_seconds)
        idle_end = time.monotonic()
        idle_foreign = load.cores()
        load = ForeignLoad(pid)
        churned = churn(base, args.model, args.models, args.updates, args.clients)
        churn_end = time.monotonic()
        churn_foreign = load.cores()
        time.sleep(args.lead_seconds)  # the churn's reconciles are done (settled); its last writes pass
        busy_start = time.monotonic()
        if args.busy_seconds > 0:
            spin_one_core(args.busy_seconds)
        busy_end = time.monotonic()
    finally:
        stream.stopping.set()
        stream.join(60)
    if stream.error is not None:
        raise RuntimeError(f"the stream failed: {stream.error!r}")
    idle = window(stream.gaps(idle_start, idle_end), idle_foreign, idle_end - idle_start)
    churning = window(stream.gaps(idle_end, churn_end), churn_foreign, churn_end - idle_end)
    spinning = window(stream.gaps(busy_start, busy_end), None, busy_end - busy_start)
    delete_churn(base)
    return {"idle": idle, "churn": {**churning, **churned}, "busy": spinning, "streams": len(stream.streams),
            "finish_reasons": stream.finish_reasons,
            "ratio_p99": ratio(churning["p99_ms"], idle["p99_ms"]),
            "ratio_p50": ratio(churning["p50_ms"], idle["p50_ms"]),
            "ratio_p99_busy": ratio(spinning["p99_ms"], idle["p99_ms"]),
            "ratio_p50_busy": ratio(spinning["p50_ms"], idle["p50_ms"])}


def median_of(runs: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value[key]
        if value is not None:
            values.append(value)
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]], goal: float) -> dict[str, Any]:
    summary = {f"{w}_{k}": median_of(runs, w, k) for w in ("idle", "churn", "busy")
               for k in ("p50_ms", "p99_ms", "max_ms", "gaps", "seconds", "foreign_cores")}
    for name in ("ratio_p99", "ratio_p50", "ratio_p99_busy", "ratio_p50_busy"):
        summary[name] = median_of(runs, name)  # median of the runs' ratios
    summary["ratio_p99_of_medians"] = ratio(summary["churn_p99_ms"], summary["idle_p99_ms"])
    pooled = {w: [g for r in runs for g in r[w]["gaps_ms"]] for w in ("idle", "churn")}
    summary["pooled_p99_ms"] = {w: percentile(g, 99) for w, g in pooled.items()}
    summary["apply_latency_ms_p50"] = median_of(runs, "churn", "apply_latency_ms_p50")
    summary["goal"] = {"ratio_p99_at_most": goal, "pass": summary["ratio_p99"] is not None
                       and summary["ratio_p99"] <= goal}
    return summary


def print_summary(runs: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print()
    print(f"{'run':<5} {'idle p50':>9} {'idle p99':>9} {'churn p50':>10} {'churn p99':>10} {'churn max':>10} "
          f"{'p99 ratio':>10} {'busy p99':>9} {'busy ratio':>11} {'gaps idle/churn':>16} {'churn s':>8}")
    for i, r in enumerate(runs):
        busy_p99 = f"{r['busy']['p99_ms']:>7.1f}ms" if r["busy"]["p99_ms"] is not None else f"{'-':>9}"
        busy_ratio = f"{r['ratio_p99_busy']:>10.2f}x" if r["ratio_p99_busy"] is not None else f"{'-':>11}"
        print(f"{i + 1:<5} {r['idle']['p50_ms']:>7.1f}ms {r['idle']['p99_ms']:>7.1f}ms {r['churn']['p50_ms']:>8.1f}ms "
              f"{r['churn']['p99_ms']:>8.1f}ms {r['churn']['max_ms']:>8.1f}ms {r['ratio_p99']:>9.2f}x "
              f"{busy_p99} {busy_ratio} {r['idle']['gaps']:>7}/{r['churn']['gaps']:<8} {r['churn']['seconds']:>7.1f}")
    s = summary
    print(f"median over {len(runs)} runs: idle p50 {s['idle_p50_ms']:.1f} ms, p99 {s['idle_p99_ms']:.1f} ms; "
          f"churn p50 {s['churn_p50_ms']:.1f} ms, p99 {s['churn_p99_ms']:.1f} ms; "
          f"p99 churn/idle {s['ratio_p99']:.2f}x (goal <= {s['goal']['ratio_p99_at_most']}x: "
          f"{'PASS' if s['goal']['pass'] else 'FAIL'})")
    if s["ratio_p99_busy"] is not None:
        print(f"for reference, one core spun by another process: p50 {s['busy_p50_ms']:.1f} ms, "
              f"p99 {s['busy_p99_ms']:.1f} ms; p99 busy/idle {s['ratio_p99_busy']:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the checkpoint streamed and churned")
    p.add_argument("--runs", type=int, default=5, help="runs (medians reported)")
    p.add_argument("--models", type=int, default=200, help="Model manifests applied per run")
    p.add_argument("--updates", type=int, default=1, help="changes applied to each Model after its creation")
    p.add_argument("--clients", type=int, default=1, help="admin API clients applying at once")
    p.add_argument("--idle-seconds", type=float, default=5.0)
    p.add_argument("--lead-seconds", type=float, default=1.0,
                   help="stream time before the idle window, and between the churn and busy windows")
    p.add_argument("--busy-seconds", type=float, default=2.0,
                   help="the reference window: another process spins one core (0: none)")
    p.add_argument("--quiet-seconds", type=float, default=2.0, help="pause between runs")
    p.add_argument("--max-tokens", type=int, default=1900)
    p.add_argument("--goal", type=float, default=1.5, help="p99 churn/idle ratio the issue asks for")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--baseline", type=Path, default=None,
                   help="a result file of this bench (another commit's): its summary is put beside this one's")
    args = p.parse_args(argv)
    args.model = args.model.expanduser().resolve()
    if not (args.model / "config.json").is_file():
        p.error(f"{args.model} is not a model directory (no config.json)")
    if min(args.runs, args.models, args.clients, args.max_tokens) < 1 or min(args.updates, args.busy_seconds) < 0:
        p.error("--runs, --models, --clients and --max-tokens must be positive, --updates and --busy-seconds "
                "not negative")
    return args


def revision() -> dict[str, Any]:
    """The commit measured, and whether the work tree differed from it."""
    def git(*cmd: str) -> str | None:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def baseline_of(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    other = json.loads(path.read_text())
    return {"path": str(path), "revision": other.get("revision"), "summary": other["summary"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    baseline = baseline_of(args.baseline)
    env, preload = child_env()
    runs: list[dict[str, Any]] = []
    host_before = host_info()
    with tempfile.TemporaryDirectory(prefix="specd-churn-") as tmp:
        home = Path(tmp)
        (home / "manifests").mkdir()
        (home / "manifests" / "stream.yaml").write_text(stream_manifest(args.model))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        argv_ = [sys.executable, "-m", "specd.cli", "daemon", "--manifests", str(home / "manifests"),
                 "--state-dir", str(home / "state"), "--host", "127.0.0.1", "--port", str(port)]
        spec = ServerSpec("specd", argv_, "/readyz", STREAM_MODEL)
        log_path = home / "daemon.log"
        with running(spec, env, log_path) as proc:
            ready_s = wait_ready(base, proc, log_path)
            print(f"daemon ready in {ready_s:.1f}s (pid {proc.pid}, {base}); model {args.model}", flush=True)
            for n in range(args.runs):
                run = one_run(base, port, proc.pid, args)
                runs.append(run)
                print(f"run {n + 1}/{args.runs}: idle p50 {run['idle']['p50_ms']:.1f} ms p99 "
                      f"{run['idle']['p99_ms']:.1f} ms ({run['idle']['gaps']} gaps); churn p50 "
                      f"{run['churn']['p50_ms']:.1f} ms p99 {run['churn']['p99_ms']:.1f} ms "
                      f"({run['churn']['gaps']} gaps, {run['churn']['seconds']:.1f}s, applies "
                      f"p50 {run['churn']['apply_latency_ms_p50']:.1f} ms); p99 ratio {run['ratio_p99']:.2f}x"
                      + (f" (one core spun: {run['ratio_p99_busy']:.2f}x)" if run["ratio_p99_busy"] is not None
                         else "") + "; "
                      f"others used {run['idle']['foreign_cores'] or 0:.2f}/{run['churn']['foreign_cores'] or 0:.2f}"
                      " cores", flush=True)
                time.sleep(args.quiet_seconds)
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited:\n{log_tail(log_path)}")
    summary = summarize(runs, args.goal)
    print_summary(runs, summary)
    if baseline is not None:
        b = baseline["summary"]
        print(f"baseline ({args.baseline}): idle p50 {b['idle_p50_ms']:.1f} ms, p99 {b['idle_p99_ms']:.1f} ms; "
              f"churn p50 {b['churn_p50_ms']:.1f} ms, p99 {b['churn_p99_ms']:.1f} ms; "
              f"p99 churn/idle {b['ratio_p99']:.2f}x")
    report = {"benchmark": "control_churn", "created_unix": time.time(), "model": str(args.model),
              "forge": forge_info(args.model),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "definitions": {"gap": "time between consecutive SSE chunks of the stream, both in the window",
                              "churn_window": "first apply until every churn Model's status is of its generation",
                              "busy_window": "a process outside the daemon spins one core; nothing else happens",
                              "ratio_p99": "median over runs of each run's p99 churn / p99 idle",
                              "ratio_p99_busy": "median over runs of each run's p99 busy / p99 idle"},
              "host": {**host_before, "loadavg_after": host_info()["loadavg"]},
              "openblas_preload": preload,
              "versions": {p: package_version(p) for p in ("mlx", "mlx-lm", "specd", "aiohttp")},
              "revision": revision(), "summary": summary, "baseline": baseline, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
