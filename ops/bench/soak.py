#!/usr/bin/env python3
"""Soak: a long mixed load against one specd daemon, watching for leaks, drift and unexpected errors.

For ``--minutes`` (20 by default; not run in CI) ``--clients`` concurrent
clients loop over a mix of requests on the demo model:

* streamed and whole chat completions, text completions, ``n = 2``,
  ``json_schema`` output, and requests asking for n-gram speculation;
* client disconnects: a stream read for a few chunks, then closed;
* invalid requests (an unknown field, a bad type, an unknown model, a broken
  body), each of which must get its 4xx;

while a control loop swaps the SpecPolicy every 30 s and edits the Model
(its ``maxWaiting``, which restarts it) every 5 minutes.  Every 10 s it
samples the daemon's RSS (``/proc``), MLX's active memory (``/metrics``) and
how long ``/readyz`` takes.  Expected answers: 2xx, the 4xx an invalid
request asked for, 429 (queue full) and 503 (the model restarting after an
edit).  Anything else is an unexpected error.

The Model's prefix cache gets a small budget (``--prefix-cache-bytes``,
64 MiB): the default, a tenth of physical memory, keeps filling for longer
than a soak runs, which is the cache doing its job, not a leak.

``--disk-bytes N`` turns on the prefix cache's disk tier (``prefixCache.disk``,
``maxBytes: N``) and adds requests with long system prompts (pieces of a code
sample, 300 to 1,500 tokens), so blocks are written, read back after each
edit's restart and evicted: the summary adds the directory's largest size
(``du``) against N and the tier's counters.

Reports: RSS growth from minute 2 to the end (goal: under 5%; one end sample
can fall just after a restart or a heap trim handed memory back, so also the
peak and the median RSS of the last five minutes against minutes 2 to 7, and
the fitted trend per minute from minute 2), unexpected errors (goal: 0),
``/readyz`` latency at the end (goal: under 100 ms), and the p50/p99 latency
of whole chat requests per minute (drift: the last five minutes against
minutes 2 to 6).

Usage (from the repository root)::

    python ops/bench/soak.py --model models/demo/target --minutes 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

import serve_vs_mlx_lm as anchor
from spec_decode import write_result
from structured import SCHEMA, TOPICS

CONTEXT = (anchor.REPO_ROOT / "specd" / "core" / "prefix.py").read_text()  # the source of long system prompts

DEFAULT_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "soak.json"
ADMIN = "/apis/specd.dev/v1alpha1"
MODEL = anchor.SPECD_MODEL_ID
INVALID = [  # (body, the status it must get)
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400),
]


def manifest(max_waiting: int, policy_k: int, prefix_cache_bytes: int, disk_bytes: int | None) -> dict[str, Any]:
    prefix_cache: dict[str, Any] = {"maxBytes": prefix_cache_bytes}
    if disk_bytes is not None:
        prefix_cache["disk"] = {"maxBytes": disk_bytes}
    return {"items": [
        {"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": MODEL, "labels": {"app": "soak"}},
         "spec": {"source": None, "maxBatchSize": 8, "maxWaiting": max_waiting, "prefixCache": prefix_cache}},
        {"apiVersion": "specd.dev/v1alpha1", "kind": "SpecPolicy", "metadata": {"name": "soak-policy"},
         "spec": {"selector": {"matchLabels": {"app": "soak"}}, "maxSpeculativeTokens": policy_k}}]}


class Soak:
    def __init__(self, base: str, source: str, pid: int, minutes: float, prefix_cache_bytes: int,
                 disk_bytes: int | None = None, disk_directory: Path | None = None):
        self.base, self.source, self.pid = base, source, pid
        self.prefix_cache_bytes = prefix_cache_bytes
        self.disk_bytes, self.disk_directory = disk_bytes, disk_directory
        self.deadline = time.monotonic() + minutes * 60
        self.started = time.monotonic()
        self.outcomes: Counter = Counter()  # (kind, status)
        self.unexpected: list[str] = []
        self.latency: dict[int, list[float]] = {}  # minute -> whole chat request seconds
        self.samples: list[dict[str, float]] = []
        self.resting = False  # clients send nothing while set (a rest spell: what is held without load)

    def minute(self) -> int:
        return int((time.monotonic() - self.started) // 60)

    def record(self, kind: str, status: int, expected: set[int], detail: str = "") -> None:
        self.outcomes[kind, status] += 1
        if status not in expected:
            self.unexpected.append(f"{kind}: {status} {detail[:200]}")

    async def apply(self, session: aiohttp.ClientSession, max_waiting: int, k: int) -> None:
        body = manifest(max_waiting, k, self.prefix_cache_bytes, self.disk_bytes)
        body["items"][0]["spec"]["source"] = self.source
        async with session.post(self.base + ADMIN + "/apply", json=body) as r:
            self.record("apply", r.status, {200}, await r.text())

    async def client(self, session: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            if self.resting:
                await asyncio.sleep(0.5)
                continue
            kinds = ["chat", "chat", "stream", "completion", "choices", "json", "ngram", "disconnect", "invalid"]
            kind = rng.choice(kinds + (["context", "context"] if self.disk_bytes is not None else []))
            question = f"Write Python to {rng.choice(TOPICS)}."
            body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": question}],
                                    "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0, 0.8])}
            if kind == "context":  # a long system prompt: blocks for the disk tier, some shared, some not
                start = rng.randrange(0, len(CONTEXT) // 2, 400)
                body["messages"].insert(0, {"role": "system", "content": CONTEXT[start:start + rng.randint(1200, 6000)]})
            expected = {200, 429, 503}
            if kind == "completion":
                body = {"model": MODEL, "prompt": question, "max_tokens": body["max_tokens"]}
            elif kind == "choices":
                body["n"] = 2
            elif kind == "json":
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}
                body["max_tokens"] = 96
            elif kind == "ngram":
                body["speculation"] = {"method": "ngram"}
            elif kind == "invalid":
                body, status = rng.choice(INVALID)
                expected = {status}
            route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
            try:
                if kind in ("stream", "disconnect"):
                    await self.stream(session, route, body, kind == "disconnect")
                else:
                    started = time.monotonic()
                    async with session.post(self.base + route, json=body) as r:
                        text = await r.text()
                        self.record(kind, r.status, expected, text)
                    if kind == "chat" and r.status == 200:
                        self.latency.setdefault(self.minute(), []).append(time.monotonic() - started)
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                self.record(kind, -1, expected, repr(err))

    async def stream(self, session: aiohttp.ClientSession, route: str, body: dict, leave: bool) -> None:
        body = {**body, "stream": True, "max_tokens": 200 if leave else body["max_tokens"]}
        async with session.post(self.base + route, json=body) as r:
            if r.status != 200:
                self.record("stream", r.status, {429, 503}, await r.text())
                return
            chunks = 0
            async for line in r.content:
                chunks += line.startswith(b"data:")
                if leave and chunks >= 3:
                    break  # closing the response drops the connection mid-stream
                if line.strip() == b"data: [DONE]":
                    break
            self.record("disconnect" if leave else "stream", 200, {200})

    async def control(self, session: aiohttp.ClientSession) -> None:
        k, edits = 2, 0
        next_edit = time.monotonic() + 300
        while time.monotonic() < self.deadline:
            await asyncio.sleep(30)
            k = 4 if k == 2 else 2
            if time.monotonic() >= next_edit:
                edits += 1
                next_edit += 300
            await self.apply(session, 64 + edits, k)

    async def sample(self, session: aiohttp.ClientSession) -> None:
        while True:
            started = time.monotonic()
            async with session.get(self.base + "/readyz") as r:
                await r.read()
            ready_s = time.monotonic() - started
            async with session.get(self.base + "/metrics") as r:
                metrics = await r.text()
            values = first_samples(metrics)
            self.samples.append({"t_s": round(time.monotonic() - self.started, 1), "rss_bytes": rss(self.pid),
                                 "mlx_active_bytes": values.get("specd_mlx_active_memory_bytes", float("nan")),
                                 "mlx_cache_bytes": values.get("specd_mlx_cache_memory_bytes", float("nan")),
                                 "prefix_cache_bytes": values.get("specd_prefix_cache_bytes", float("nan")),
                                 "disk_bytes": directory_bytes(self.disk_directory), "readyz_s": ready_s})
            if time.monotonic() >= self.deadline:
                return
            await asyncio.sleep(10)


def first_samples(metrics: str) -> dict[str, float]:
    """Each series' first sample in a Prometheus text page (the model's, for
    labelled series), read with Prometheus' own parser."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            values.setdefault(sample.name, sample.value)
    return values


def directory_bytes(directory: Path | None) -> float:
    """What the files under ``directory`` take (NaN without one)."""
    if directory is None:
        return float("nan")
    return float(sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()))


def rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    return float("nan")


def rss_growth(samples: list[dict[str, float]], statistic: Callable[[list[float]], float]) -> float:
    """``statistic`` of the RSS sampled in the last five minutes against minutes
    2 to 7 (NaN in a run too short to have both)."""
    late_from = samples[-1]["t_s"] - 300
    late = [s["rss_bytes"] for s in samples if s["t_s"] >= late_from]
    early = [s["rss_bytes"] for s in samples if 120 <= s["t_s"] < 420]
    return statistic(late) / statistic(early) - 1 if late and early else float("nan")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def run(args, env: dict, workdir: Path) -> dict[str, Any]:
    port = anchor.free_port()
    argv = [sys.executable, "-m", "specd.cli", "daemon", "--state-dir", str(workdir / "state"),
            "--host", "127.0.0.1", "--port", str(port)]  # objects come through the admin API only
    spec = anchor.ServerSpec("specd", argv, "/readyz", MODEL)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        with anchor.running(spec, env, workdir / "specd.log") as proc:
            base = f"http://127.0.0.1:{port}"
            soak = Soak(base, str(Path(args.model).resolve()), proc.pid, args.minutes, args.prefix_cache_bytes,
                        args.disk_bytes, workdir / "state" / "prefix-cache" / MODEL)
            await anchor.wait_ready(session, base, spec, proc, workdir / "specd.log")
            await soak.apply(session, 64, 2)
            await anchor.wait_ready(session, base, spec, proc, workdir / "specd.log")
            soak.deadline = time.monotonic() + args.minutes * 60
            soak.started = time.monotonic()
            await asyncio.gather(soak.sample(session), soak.control(session),
                                 *(soak.client(session, seed) for seed in range(args.clients)))
            started = time.monotonic()
            async with session.get(base + "/readyz") as r:
                ready_status = r.status
            final_ready_s = time.monotonic() - started
            async with session.get(base + ADMIN + f"/models/{MODEL}") as r:
                status = (await r.json()).get("status", {})
            log = anchor.log_tail(workdir / "specd.log", 20)
    result = summarize(soak, ready_status, final_ready_s, log)
    if args.disk_bytes is not None:
        seen = [s["disk_bytes"] for s in soak.samples]
        result["disk"] = {"max_bytes": args.disk_bytes, "largest_directory_bytes": max(seen),
                          "within_max_bytes": max(seen) <= args.disk_bytes,
                          "status_at_end": status.get("prefixCache", {}).get("disk")}
    return result


def summarize(soak: Soak, ready_status: int, final_ready_s: float, log: str) -> dict[str, Any]:
    after_warmup = [s for s in soak.samples if s["t_s"] >= 120]
    first, last = after_warmup[0] if after_warmup else soak.samples[0], soak.samples[-1]
    minutes = sorted(soak.latency)
    per_minute = {m: {"p50_s": percentile(soak.latency[m], 0.5), "p99_s": percentile(soak.latency[m], 0.99),
                      "n": len(soak.latency[m])} for m in minutes}
    early = [x for m in minutes if 2 <= m < 7 for x in soak.latency[m]]
    late = [x for m in minutes[-5:] for x in soak.latency[m]]
    return {
        "rss_growth_from_minute_2": last["rss_bytes"] / first["rss_bytes"] - 1,
        "rss_peak_growth": rss_growth(soak.samples, max),
        "rss_median_growth": rss_growth(soak.samples, statistics.median),
        "rss_trend_bytes_per_minute": statistics.linear_regression(
            [s["t_s"] / 60 for s in after_warmup], [s["rss_bytes"] for s in after_warmup]).slope
        if len(after_warmup) >= 2 else float("nan"),
        "mlx_active_growth_from_minute_2": last["mlx_active_bytes"] / first["mlx_active_bytes"] - 1
        if first["mlx_active_bytes"] else None,
        "unexpected_errors": len(soak.unexpected), "unexpected_examples": soak.unexpected[:20],
        "outcomes": {f"{k} {s}": n for (k, s), n in sorted(soak.outcomes.items())},
        "final_readyz_status": ready_status, "final_readyz_s": final_ready_s,
        "max_readyz_s": max(s["readyz_s"] for s in soak.samples),
        "latency_drift": {"p50_early_s": percentile(early, 0.5), "p50_late_s": percentile(late, 0.5),
                          "p99_early_s": percentile(early, 0.99), "p99_late_s": percentile(late, 0.99)},
        "per_minute": per_minute, "samples": soak.samples, "daemon_log_tail": log}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(anchor.REPO_ROOT / "models" / "demo" / "target"))
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--prefix-cache-bytes", type=int, default=64 * 1024 * 1024,
                        help="the Model's prefixCache.maxBytes: small, so the cache is full before minute 2 "
                             "and its (bounded) growth is not mistaken for a leak")
    parser.add_argument("--disk-bytes", type=int, default=None,
                        help="turn on the prefix cache's disk tier with this maxBytes, and send long prompts")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    env, _ = anchor.child_env()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args, env, Path(tmp)))
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "per_minute", "daemon_log_tail")},
                     indent=2, default=str))
    write_result(args.out, {"minutes": args.minutes, "clients": args.clients, "model": args.model,
                            "prefix_cache_bytes": args.prefix_cache_bytes, "disk_bytes": args.disk_bytes,
                            "host": anchor.host_info(), **result})
    return 0 if result["unexpected_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
