#!/usr/bin/env python3
"""Benchmark specd against ``mlx_lm.server`` on the same model and prompts.

Both servers are started by this script, on free ports of 127.0.0.1, and
warmed up with one request each; then, at every requested concurrency, they
take turns run by run (which goes first alternates), so a machine whose speed
drifts over minutes slows both alike, and only one is ever busy (an idle
server uses no CPU).  One *run* fires ``c`` streaming ``/v1/completions``
requests at once and waits for all of them.  Per run we record

* aggregate output tokens/s = total completion tokens / wall time of the run;
* the median time to first content chunk (TTFT) of its requests.

The reported figure per server is the median over runs (timings on a shared
machine are noisy), and the comparison is the ratio specd / mlx_lm.

Fairness choices, all recorded in the JSON:

* raw text prompts on ``/v1/completions`` (no chat template), greedy decoding,
  the same ``max_tokens``; prompt token counts reported by both servers are
  compared, so a tokenisation difference (e.g. an added BOS) would show;
* completion tokens are taken from each server's own ``usage`` (both send it
  when asked with ``stream_options.include_usage``), never assumed to equal
  ``max_tokens``: a model may emit EOS early;
* ``mlx_lm.server`` batches concurrent requests by default
  (``--decode-concurrency 32``, ``--prompt-concurrency 8``); we pass both
  explicitly so the comparison is batched-vs-batched;
* both servers run with their prompt caches on, as their users run them:
  ``mlx_lm.server``'s LRU prompt cache and specd's prefix cache (every run
  sends the same prompts, so from the second run on both can skip prefill).
  ``--no-prompt-cache`` turns both off (``--prompt-cache-size 0``, and
  ``prefixCache.maxBytes: 0``) to compare the engines doing the same work;
* ``mlx_lm.server``'s listen backlog is raised from 5 to 64 (see
  ``mlx_lm_spec``), else c=8 runs measure 1 s SYN retransmits, not serving;
  ``--mlx-lm-backlog 0`` keeps the stock server;
* specd runs at its defaults (a Model names no ``maxBatchSize``: 32 rows, as
  many as ``mlx_lm.server`` decodes together by default);
* with ``--rounds N`` both servers are started N times, and the runs of all
  rounds are pooled before taking medians;
* the machine is shared: a run during which other processes used more than
  ``--max-foreign-cores`` CPU cores (measured from /proc) is redone, up to
  ``--retries`` times; the kept runs' background load is in the JSON.

Usage (from the repository root)::

    python ops/bench/serve_vs_mlx_lm.py --model models/demo/target --runs 5 --concurrency 1 4 8 16 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "demo" / "target"
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "serve_vs_mlx_lm.json"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
SPECD_MODEL_ID = "bench"
MLX_LM_BATCH_FLAGS = ("--decode-concurrency", "32", "--prompt-concurrency", "8")
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0

# Code-continuation prompts: the demo model is trained on Python sources.
PROMPTS: tuple[str, ...] = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "try:\n    import json\nexcept ImportError:\n",
)


# --------------------------------------------------------------------------
# Results


@dataclass
class RequestResult:
    """One streamed completion, as the client saw it."""

    prompt_index: int
    ttft_s: float | None  # None if no content chunk ever arrived
    latency_s: float
    completion_tokens: int
    prompt_tokens: int | None
    usage_reported: bool  # False: completion_tokens counts content chunks
    content_chunks: int
    finish_reason: str | None
    text: str


@dataclass
class RunResult:
    """``concurrency`` requests fired together and awaited together."""

    concurrency: int
    wall_s: float
    completion_tokens: int
    tok_s: float
    ttft_ms_median: float | None
    # CPU cores other processes used meanwhile (None where /proc is missing),
    # and how many attempts it took to get a run below the busy threshold.
    foreign_cores: float | None = None
    attempts: int = 1
    requests: list[RequestResult] = field(default_factory=list)


# server name -> its sessions (one per round), as bench_server returns them
Results = dict[str, list[dict[str, Any]]]


@dataclass(frozen=True)
class Plan:
    """What to measure on each server, and when a run is too disturbed to keep."""

    concurrencies: list[int]
    runs: int
    max_tokens: int
    max_foreign_cores: float
    retries: int


@dataclass
class ServerSpec:
    """How to start one server and address its model."""

    name: str
    argv: list[str]
    ready_path: str
    model_id: str


# --------------------------------------------------------------------------
# Server processes


def free_port() -> int:
    """A port the kernel says is free right now on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> tuple[dict[str, str], str]:
    """The environment both servers get, and how LD_PRELOAD came to be set.

    OpenBLAS makes MLX's fp32 CPU matmuls ~40x faster; both servers must get
    the same BLAS or the comparison measures BLAS, not serving.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    preload = env.get("LD_PRELOAD", "")
    if OPENBLAS in preload.split(":"):
        return env, "inherited"
    if not Path(OPENBLAS).exists():
        return env, "missing"
    env["LD_PRELOAD"] = f"{OPENBLAS}:{preload}" if preload else OPENBLAS
    return env, "added"


def specd_spec(model: Path, workdir: Path, port: int, draft: Path | None = None,
               num_draft: int = 3, ngram: bool = False, prompt_cache: bool = True) -> ServerSpec:
    """specd serving ``model`` from a one-file manifest directory (with a
    draft-model DraftPairing when ``draft`` is given, an n-gram one with
    ``ngram``; its prefix cache off unless ``prompt_cache``)."""
    manifests = workdir / "manifests"
    manifests.mkdir()
    text = (
        "apiVersion: specd.dev/v1alpha1\n"
        "kind: Model\n"
        "metadata:\n"
        f"  name: {SPECD_MODEL_ID}\n"
        "spec:\n"
        f"  source: {model}\n"
    )
    if not prompt_cache:
        text += "  prefixCache: {maxBytes: 0}\n"
    if draft is not None or ngram:
        source = f"  method: draft\n  source: {draft}\n" if draft is not None else "  method: ngram\n"
        text += ("---\napiVersion: specd.dev/v1alpha1\nkind: DraftPairing\nmetadata:\n  name: bench-draft\n"
                 f"spec:\n  targetRef: {SPECD_MODEL_ID}\n{source}  numSpeculativeTokens: {num_draft}\n")
    (manifests / "bench.yaml").write_text(text)
    argv = [sys.executable, "-m", "specd.cli", "daemon", "--manifests", str(manifests),
            "--state-dir", str(workdir / "state"), "--host", "127.0.0.1", "--port", str(port)]
    return ServerSpec("specd", argv, "/readyz", SPECD_MODEL_ID)


def mlx_lm_spec(model: Path, port: int, prompt_cache: bool, backlog: int, draft: Path | None = None,
                num_draft: int = 3) -> ServerSpec:
    """mlx_lm.server with batching on, and its prompt cache unless ``prompt_cache`` is False.

    mlx_lm.server is a ``ThreadingHTTPServer`` speaking HTTP/1.0, so every
    request opens a new connection, and its listen backlog is socketserver's
    default of 5.  Eight simultaneous connects overflow it: the kernel drops
    the extra SYNs and the client retries them after 1 s, which would show up
    as a 1 s TTFT for the last requests of every c=8 run.  That measures the
    stdlib socket setup, not the engine, so unless ``backlog`` is 0 we start
    the server through a bootstrap that raises the backlog first.
    """
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            *MLX_LM_BATCH_FLAGS]
    if draft is not None:  # mlx_lm.server then decodes one request at a time
        args += ["--draft-model", str(draft), "--num-draft-tokens", str(num_draft)]
    if backlog > 0:
        bootstrap = ("import socketserver, sys; "
                     f"socketserver.TCPServer.request_queue_size = {backlog}; "
                     "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()")
        argv = [sys.executable, "-c", bootstrap, *args]
    else:
        argv = [sys.executable, "-m", "mlx_lm", "server", *args]
    if not prompt_cache:
        argv += ["--prompt-cache-size", "0"]
    # The model field must equal --model for mlx_lm to use the loaded model.
    return ServerSpec("mlx_lm", argv, "/v1/models", str(model))


@contextlib.contextmanager
def running(spec: ServerSpec, env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen]:
    """Run a server in its own process group; always kill the whole group.

    A new session means SIGTERM/SIGKILL reach every process the server
    spawned, and a Ctrl-C in this terminal does not hit the server directly
    (we stop it ourselves, in order).
    """
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec.argv, env=env, cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


async def wait_ready(session: aiohttp.ClientSession, base: str, spec: ServerSpec,
                     proc: subprocess.Popen, log_path: Path) -> float:
    """Poll the readiness endpoint until it answers 200; return seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with {proc.returncode}:\n{log_tail(log_path)}")
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(base + spec.ready_path,
                                   timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{spec.name} not ready after {READY_TIMEOUT_S:.0f}s:\n{log_tail(log_path)}")


def log_tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


# --------------------------------------------------------------------------
# Background load


class ForeignLoad:
    """CPU used by processes other than the server under test and this script.

    The machine is shared, and another job's burst can halve a run's
    throughput.  From /proc we get all CPU time spent and the server's and
    our own, so the difference says how many cores someone else took during
    the run; runs above ``--max-foreign-cores`` are redone.
    """

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.start = self._sample()

    def _sample(self) -> tuple[float, int, int, int] | None:
        try:
            cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
            busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
            return time.monotonic(), busy, _process_ticks(self.server_pid), _process_ticks("self")
        except (OSError, ValueError, IndexError):
            return None

    def cores(self) -> float | None:
        """Average cores used by others since construction."""
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        (t0, busy0, srv0, me0), (t1, busy1, srv1, me1) = self.start, end
        foreign = (busy1 - busy0) - (srv1 - srv0) - (me1 - me0)
        return max(0.0, foreign / self.TICK / (t1 - t0))


def _process_ticks(pid: int | str) -> int:
    """utime + stime of a process, all threads (fields 14 and 15 of its stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


# --------------------------------------------------------------------------
# Client


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style server-sent stream, up to ``[DONE]``."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        yield json.loads(line[len("data:"):])


async def stream_completion(session: aiohttp.ClientSession, base: str, model_id: str,
                            prompt_index: int, max_tokens: int) -> RequestResult:
    """One greedy streaming text completion; TTFT is the first non-empty text.

    Both servers may send chunks with empty text (role/usage/finish chunks,
    or a token whose bytes do not yet form a character), so "first content"
    is the fair common definition.
    """
    body = {
        "model": model_id,
        "prompt": PROMPTS[prompt_index],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    chunks, finish, parts = 0, None, []
    async with session.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {base}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error from {base}: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                text = choice.get("text") or ""
                if text:
                    chunks += 1
                    parts.append(text)
                    if ttft is None:
                        ttft = time.perf_counter() - started
    latency = time.perf_counter() - started
    return RequestResult(
        prompt_index=prompt_index,
        ttft_s=ttft,
        latency_s=latency,
        completion_tokens=int(usage["completion_tokens"]) if usage else chunks,
        prompt_tokens=int(usage["prompt_tokens"]) if usage else None,
        usage_reported=usage is not None,
        content_chunks=chunks,
        finish_reason=finish,
        text="".join(parts),
    )


async def measure_run(session: aiohttp.ClientSession, base: str, model_id: str,
                      concurrency: int, max_tokens: int, server_pid: int) -> RunResult:
    """Fire ``concurrency`` requests (distinct prompts) at once, await all."""
    load = ForeignLoad(server_pid)
    started = time.perf_counter()
    requests = await asyncio.gather(*(
        stream_completion(session, base, model_id, i % len(PROMPTS), max_tokens)
        for i in range(concurrency)))
    wall = time.perf_counter() - started
    tokens = sum(r.completion_tokens for r in requests)
    ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
    return RunResult(
        concurrency=concurrency,
        wall_s=wall,
        completion_tokens=tokens,
        tok_s=tokens / wall,
        ttft_ms_median=statistics.median(ttfts) * 1000 if ttfts else None,
        foreign_cores=load.cores(),
        requests=list(requests),
    )


async def measure_quiet_run(session: aiohttp.ClientSession, base: str, spec: ServerSpec,
                            concurrency: int, plan: Plan, server_pid: int) -> RunResult:
    """A run during which other processes stayed under the busy threshold,
    or the last of ``plan.retries + 1`` attempts if they never did."""
    for attempt in range(1, plan.retries + 2):
        run = await measure_run(session, base, spec.model_id, concurrency, plan.max_tokens,
                                server_pid)
        run.attempts = attempt
        if run.foreign_cores is None or run.foreign_cores <= plan.max_foreign_cores:
            break
        print(f"[{spec.name}] c={concurrency}: other processes used {run.foreign_cores:.2f} cores "
              f"(> {plan.max_foreign_cores}), attempt {attempt}/{plan.retries + 1}", flush=True)
    return run


@dataclass
class Running:
    """A started, warmed-up server and its runs so far."""

    spec: ServerSpec
    base: str
    proc: subprocess.Popen
    log_path: Path
    ready_s: float
    warmup_s: float
    warmup_tokens: int
    runs: dict[str, list[RunResult]] = field(default_factory=dict)

    def session(self) -> dict[str, Any]:
        """The server's start-up figures and its runs by concurrency (keys are strings, as in the JSON)."""
        return {"argv": self.spec.argv, "log": log_tail(self.log_path), "ready_s": self.ready_s,
                "warmup_s": self.warmup_s, "warmup_completion_tokens": self.warmup_tokens, "runs": self.runs}


async def start_server(stack: contextlib.ExitStack, session: aiohttp.ClientSession, spec: ServerSpec, port: int,
                       env: dict[str, str], workdir: Path, max_tokens: int) -> Running:
    """Start one server (stopped when ``stack`` closes), wait for it, warm it up with one request."""
    base = f"http://127.0.0.1:{port}"
    log_path = workdir / f"{spec.name}.log"
    proc = stack.enter_context(running(spec, env, log_path))
    print(f"[{spec.name}] starting on port {port} (log: {log_path})", flush=True)
    ready_s = await wait_ready(session, base, spec, proc, log_path)
    started = time.perf_counter()
    warmup = await stream_completion(session, base, spec.model_id, 0, max_tokens)
    warmup_s = time.perf_counter() - started
    print(f"[{spec.name}] ready in {ready_s:.1f}s, warm-up request {warmup_s:.2f}s "
          f"({warmup.completion_tokens} tokens)", flush=True)
    return Running(spec, base, proc, log_path, ready_s, warmup_s, warmup.completion_tokens)


async def bench_round(specs: list[tuple[ServerSpec, int]], env: dict[str, str], workdir: Path,
                      plan: Plan) -> list[Running]:
    """Start every server, then at each concurrency let them take turns run by run (who goes
    first alternates), so that drift in the machine's speed falls on all of them alike."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        with contextlib.ExitStack() as stack:
            servers = [await start_server(stack, session, spec, port, env, workdir, plan.max_tokens)
                       for spec, port in specs]
            for c in plan.concurrencies:
                for server in servers:
                    server.runs[str(c)] = []
                for r in range(plan.runs):
                    order = servers if r % 2 == 0 else servers[::-1]
                    for server in order:
                        run = await measure_quiet_run(session, server.base, server.spec, c, plan, server.proc.pid)
                        server.runs[str(c)].append(run)
                        print(f"[{server.spec.name}] c={c} run {r + 1}/{plan.runs}: {run.tok_s:7.1f} tok/s, "
                              f"ttft {fmt_ms(run.ttft_ms_median)} ms, {run.completion_tokens} tokens "
                              f"in {run.wall_s:.2f}s, others {fmt_cores(run.foreign_cores)} cores", flush=True)
    return servers


# --------------------------------------------------------------------------
# Summary


def pooled(results: Results, server: str, key: str) -> list[RunResult]:
    """All runs of one server at one concurrency, over every round."""
    return [run for session in results[server] for run in session["runs"][key]]


def fmt_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.1f}"


def fmt_cores(cores: float | None) -> str:
    return "n/a" if cores is None else f"{cores:.2f}"


def fmt_x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: Results, concurrencies: list[int],
              max_foreign_cores: float) -> dict[str, Any]:
    """Medians over runs per server, ratios, and token-count agreement.

    The best run is kept too: background load only ever slows a run down, so
    when medians and bests disagree the machine was too busy to trust either.
    """
    summary: dict[str, Any] = {}
    for c in concurrencies:
        key = str(c)
        row: dict[str, Any] = {}
        for server in ("specd", "mlx_lm"):
            runs = pooled(results, server, key)
            row[server] = {
                "tok_s_median": statistics.median(r.tok_s for r in runs),
                "tok_s_best": max(r.tok_s for r in runs),
                "ttft_ms_median": median_or_none([r.ttft_ms_median for r in runs]),
                "completion_tokens_per_run": [r.completion_tokens for r in runs],
                "prompt_tokens": sorted({q.prompt_tokens for r in runs for q in r.requests},
                                        key=lambda v: -1 if v is None else v),
                "usage_reported": all(q.usage_reported for r in runs for q in r.requests),
                "foreign_cores_median": median_or_none([r.foreign_cores for r in runs]),
                "busy_runs_kept": sum(r.foreign_cores is not None
                                      and r.foreign_cores > max_foreign_cores for r in runs),
            }
        row["ratio_tok_s"] = ratio(row["specd"]["tok_s_median"], row["mlx_lm"]["tok_s_median"])
        row["ratio_tok_s_best"] = ratio(row["specd"]["tok_s_best"], row["mlx_lm"]["tok_s_best"])
        row["ratio_ttft"] = ratio(row["specd"]["ttft_ms_median"], row["mlx_lm"]["ttft_ms_median"])
        row["same_token_counts"] = (row["specd"]["completion_tokens_per_run"]
                                    == row["mlx_lm"]["completion_tokens_per_run"])
        row["same_prompt_tokens"] = row["specd"]["prompt_tokens"] == row["mlx_lm"]["prompt_tokens"]
        row["same_text_first_run"] = same_texts(results, key)
        summary[key] = row
    return summary


def same_texts(results: Results, key: str) -> float:
    """Fraction of first-run requests whose greedy text is identical on both
    servers: a sanity check that they ran the same model the same way.

    Trailing U+FFFD is ignored: when a sequence ends (EOS) on a token whose
    bytes are an incomplete character, specd flushes it as U+FFFD while
    mlx_lm drops it; the tokens are the same.  Batched fp32 arithmetic may
    also legitimately flip a near-tie late in a long output.
    """
    a = pooled(results, "specd", key)[0].requests
    b = pooled(results, "mlx_lm", key)[0].requests
    same = (x.text.rstrip("\ufffd") == y.text.rstrip("\ufffd") for x, y in zip(a, b, strict=True))
    return sum(same) / len(a)


def goal_check(summary: dict[str, Any]) -> dict[str, Any]:
    """specd >= 1.0x mlx_lm tok/s at every concurrency measured."""
    checks = {}
    for key in summary:
        need = 1.0
        got = summary.get(key, {}).get("ratio_tok_s")
        checks[f"c{key}"] = {"required": need, "ratio_tok_s": got,
                             "pass": None if got is None else got >= need}
    measured = [c["pass"] for c in checks.values() if c["pass"] is not None]
    checks["pass"] = bool(measured) and all(measured)
    return checks


def print_table(summary: dict[str, Any], goal: dict[str, Any]) -> None:
    print()
    print(f"{'concurrency':<12} {'server':<8} {'tok/s(median)':>14} {'tok/s(best)':>12} "
          f"{'ttft_ms(median)':>16}")
    for key, row in summary.items():
        for server in ("specd", "mlx_lm"):
            s = row[server]
            print(f"{key:<12} {server:<8} {s['tok_s_median']:>14.1f} {s['tok_s_best']:>12.1f} "
                  f"{fmt_ms(s['ttft_ms_median']):>16}")
        print(f"ratio specd/mlx_lm: tok/s {fmt_x(row['ratio_tok_s'])}, "
              f"ttft {fmt_x(row['ratio_ttft'])}  (best-run tok/s {fmt_x(row['ratio_tok_s_best'])})")
        if not row["same_token_counts"]:
            print(f"  note: completion tokens differ: specd {row['specd']['completion_tokens_per_run']}"
                  f" vs mlx_lm {row['mlx_lm']['completion_tokens_per_run']}")
        if not row["same_prompt_tokens"]:
            print(f"  note: prompt token counts differ: specd {row['specd']['prompt_tokens']}"
                  f" vs mlx_lm {row['mlx_lm']['prompt_tokens']}")
        for server in ("specd", "mlx_lm"):
            if row[server]["busy_runs_kept"]:
                print(f"  note: {row[server]['busy_runs_kept']} {server} run(s) kept although other "
                      "processes were busy (retries exhausted): treat this row with care")
            if not row[server]["usage_reported"]:
                print(f"  note: {server} sent no usage; its tokens are counted as content chunks")
        print(f"  identical greedy text (first run): {row['same_text_first_run']:.0%}")
    verdicts = ", ".join(
        f"c={k[1:]}: {v['ratio_tok_s']:.2f}x vs >= {v['required']}x {'PASS' if v['pass'] else 'FAIL'}"
        for k, v in goal.items() if k != "pass" and v["ratio_tok_s"] is not None)
    print(f"goal: {verdicts or 'not measured'} -> {'PASS' if goal['pass'] else 'FAIL'}")


# --------------------------------------------------------------------------
# Metadata and main


def package_version(name: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(name)
    return None


def forge_info(model: Path) -> Any:
    """The forge's record of how the model was built, if it left one."""
    path = model.parent / "forge.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"unparsed": path.read_text()}


def host_info() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "loadavg": os.getloadavg()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="mlx-lm model directory")
    p.add_argument("--runs", type=int, default=5, help="runs per concurrency (median reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="start both servers this many times; runs of all rounds are pooled")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    p.add_argument("--max-foreign-cores", type=float, default=0.5,
                   help="redo a run if other processes used more CPU cores than this meanwhile")
    p.add_argument("--retries", type=int, default=3,
                   help="redos per run before keeping a disturbed one anyway")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="speculate with this draft model on both servers (specd: a DraftPairing; "
                        "mlx_lm.server: --draft-model)")
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                   help="turn off mlx_lm.server's prompt cache and specd's prefix cache (both on by default)")
    p.add_argument("--mlx-lm-backlog", type=int, default=64,
                   help="listen backlog for mlx_lm.server (0: its stock 5, which drops "
                        "connects beyond ~6 simultaneous ones for 1 s)")
    args = p.parse_args(argv)
    if min(args.runs, args.rounds, args.max_tokens, *args.concurrency) < 1:
        p.error("--runs, --rounds, --max-tokens and --concurrency must be positive")
    if args.retries < 0 or args.max_foreign_cores < 0:
        p.error("--retries and --max-foreign-cores must not be negative")
    args.model = args.model.expanduser().resolve()
    if args.draft_model is not None:
        args.draft_model = args.draft_model.expanduser().resolve()
    if not (args.model / "config.json").is_file():
        p.error(f"{args.model} is not an mlx-lm model directory (no config.json)")
    return args


async def bench(args: argparse.Namespace, env: dict[str, str], workdir: Path) -> Results:
    """Benchmark both servers, taking turns run by run, ``--rounds`` times (fresh servers each)."""
    plan = Plan(args.concurrency, args.runs, args.max_tokens, args.max_foreign_cores, args.retries)
    results: Results = {"specd": [], "mlx_lm": []}
    for n in range(args.rounds):
        roundir = workdir / f"round{n}"
        roundir.mkdir()
        draft = dict(draft=args.draft_model, num_draft=args.num_draft_tokens)
        ports: list[int] = []
        while len(ports) < 2:  # neither is bound until its server starts: two different ones
            if (port := free_port()) not in ports:
                ports.append(port)
        builds = (partial(specd_spec, args.model, roundir, prompt_cache=args.prompt_cache, **draft),
                  partial(mlx_lm_spec, args.model, prompt_cache=args.prompt_cache, backlog=args.mlx_lm_backlog,
                          **draft))
        specs = [(build(port), port) for build, port in zip(builds, ports)]
        if n % 2:
            specs.reverse()
        for server in await bench_round(specs, env, roundir, plan):
            results[server.spec.name].append({"round": n, **server.session()})
    return results


def to_jsonable(results: Results) -> dict[str, Any]:
    return {server: [{**s, "runs": {c: [asdict(r) for r in runs] for c, runs in s["runs"].items()}}
                     for s in sessions]
            for server, sessions in results.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env, preload = child_env()
    print(f"model: {args.model}" + (f", draft: {args.draft_model} (k={args.num_draft_tokens})"
                                    if args.draft_model else ""))
    print(f"LD_PRELOAD OpenBLAS for servers: {preload} (LD_PRELOAD={env.get('LD_PRELOAD', '')!r})")
    if preload == "missing":
        print(f"warning: {OPENBLAS} not found; MLX fp32 matmuls will be slow", file=sys.stderr)
    # SIGTERM becomes SystemExit so the `finally`s stop the servers, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    host_before = host_info()
    try:
        with tempfile.TemporaryDirectory(prefix="specd-bench-") as tmp:
            results = asyncio.run(bench(args, env, Path(tmp)))
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped, nothing written", file=sys.stderr)
        return 130
    summary = summarize(results, args.concurrency, args.max_foreign_cores)
    goal = goal_check(summary)
    print_table(summary, goal)
    report = {
        "benchmark": "serve_vs_mlx_lm",
        "created_unix": time.time(),
        "model": str(args.model),
        "forge": forge_info(args.model),
        "config": {"runs": args.runs, "rounds": args.rounds, "max_tokens": args.max_tokens,
                   "max_foreign_cores": args.max_foreign_cores, "retries": args.retries,
                   "concurrency": args.concurrency, "prompts": list(PROMPTS),
                   "prompt_cache": args.prompt_cache,
                   "draft_model": str(args.draft_model) if args.draft_model else None,
                   "num_draft_tokens": args.num_draft_tokens if args.draft_model else None,
                   "mlx_lm_listen_backlog": args.mlx_lm_backlog or 5,
                   "specd_max_batch_size": "default (32)", "mlx_lm_batch_flags": list(MLX_LM_BATCH_FLAGS),
                   "tok_s_definition": "sum of usage.completion_tokens / wall time of the run",
                   "ttft_definition": "time to first streamed chunk with non-empty text"},
        "host": {**host_before, "loadavg_after": os.getloadavg()},
        "openblas_preload": {"state": preload, "LD_PRELOAD": env.get("LD_PRELOAD")},
        "versions": {p: package_version(p) for p in ("mlx", "mlx-lm", "specd", "aiohttp")},
        "summary": summary,
        "goal": goal,
        "results": to_jsonable(results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
