#!/usr/bin/env python3
"""The prefix cache's disk tier across a daemon restart: time to first token of a long prompt
read back from disk, against a cold prefill of the same request and a hit in RAM.

For each prompt size (``--tokens``, 8k and 32k by default) and run, one daemon serves the demo
agent model twice, as ``bench`` (``prefixCache.disk`` on) and as ``cold`` (prefix cache off):

1. a conversation's first request to ``bench`` (cold: its prefix is written to disk as it is
   prefilled), then the same request again (a RAM hit);
2. the daemon is stopped (SIGTERM: it writes what is queued) and started again on the same state
   directory;
3. the conversation's next request (the first one's prompt, its reply and a new question) to
   ``bench``, which reads the prefix from disk, then to ``cold``, a cold prefill of the same request.

Each run's prompt opens with its own line, so no run finds another's prefix. Reported per size:
the medians of each time to first token, ``cached_tokens`` and the ratio disk / cold (goal at 32k:
at most 0.1), and the tier's restore time and bytes read from ``/metrics``.

Usage (from the repository root)::

    python ops/bench/prefix_disk.py --tokens 8192 32768 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

import serve_vs_mlx_lm as anchor
from spec_decode import write_result

DEFAULT_MODEL = anchor.REPO_ROOT / "models" / "demo" / "agent"
DEFAULT_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "prefix_disk.json"
SOURCES = sorted((anchor.REPO_ROOT / "specd").rglob("*.py"))  # the text of the long prompts
GOAL_RATIO = 0.1  # disk / cold time to first token at 32k tokens


def corpus() -> str:
    return "\n\n".join(p.read_text() for p in SOURCES)


def prompt_text(tokenizer, run: int, tokens: int) -> str:
    """About ``tokens`` tokens of specd's own source, opened by a line of this run's."""
    text, ids = corpus(), None
    chars = tokens * 3
    while True:
        body = f"Run {run}: read this code.\n\n" + text[:chars]
        ids = tokenizer.encode(body)
        if len(ids) >= tokens or chars >= len(text):
            return tokenizer.decode(ids[:tokens])
        chars = int(chars * tokens / len(ids)) + 64


def manifests(model: Path, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "bench.yaml").write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: bench}\n"
        f"spec: {{source: {model}, maxBatchSize: 4, prefillStepTokens: 2048, prefixCache: {{disk: {{}}}}}}\n"
        "---\napiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: cold}\n"
        f"spec: {{source: {model}, maxBatchSize: 4, prefillStepTokens: 2048, prefixCache: {{maxBytes: 0}}}}\n")


async def ask(session: aiohttp.ClientSession, base: str, model: str, messages: list[dict]) -> dict[str, Any]:
    """A streamed chat completion: its time to first token, reply and cached prompt tokens."""
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, "", {}
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for event in anchor.sse_events(resp):
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if first is None and (delta.get("content") or delta.get("reasoning_content")):
                    first = time.perf_counter() - started
                text += delta.get("content") or ""
            usage = event.get("usage") or usage
    return {"ttft_s": first if first is not None else time.perf_counter() - started, "text": text,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(base + "/metrics") as resp:
        page = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == name and s.labels.get("model_name") == "bench")


async def one_run(args, env: dict, workdir: Path, tokenizer, run: int, tokens: int) -> dict[str, Any]:
    state = workdir / f"run-{tokens}-{run}"
    manifests(Path(args.model).resolve(), state / "manifests")
    port = anchor.free_port()
    argv = [sys.executable, "-m", "specd.cli", "daemon", "--manifests", str(state / "manifests"),
            "--state-dir", str(state / "state"), "--host", "127.0.0.1", "--port", str(port)]
    spec = anchor.ServerSpec("specd", argv, "/readyz", "bench")
    base = f"http://127.0.0.1:{port}"
    first_turn = [{"role": "user", "content": prompt_text(tokenizer, run, tokens)}]
    timeout = aiohttp.ClientTimeout(total=anchor.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with anchor.running(spec, env, state / "specd-1.log") as proc:
            await anchor.wait_ready(session, base, spec, proc, state / "specd-1.log")
            cold_first = await ask(session, base, "bench", first_turn)
            ram = await ask(session, base, "bench", first_turn)
            written = await metric(session, base, "specd_prefix_disk_written_bytes_total")
        second_turn = first_turn + [{"role": "assistant", "content": cold_first["text"]},
                                    {"role": "user", "content": "Which function would you test first?"}]
        with anchor.running(spec, env, state / "specd-2.log") as proc:
            await anchor.wait_ready(session, base, spec, proc, state / "specd-2.log")
            disk = await ask(session, base, "bench", second_turn)
            cold = await ask(session, base, "cold", second_turn)
            restore_s = await metric(session, base, "specd_prefix_disk_restore_seconds_sum")
            read = await metric(session, base, "specd_prefix_disk_read_bytes_total")
    assert disk["text"] == cold["text"], "the answer read from disk differs from a cold prefill's"
    return {"tokens": tokens, "run": run, "prompt_tokens": disk["prompt_tokens"],
            "cold_first_ttft_s": cold_first["ttft_s"], "ram_ttft_s": ram["ttft_s"],
            "ram_cached_tokens": ram["cached_tokens"], "disk_ttft_s": disk["ttft_s"],
            "disk_cached_tokens": disk["cached_tokens"], "cold_ttft_s": cold["ttft_s"],
            "disk_vs_cold": disk["ttft_s"] / cold["ttft_s"], "restore_s": restore_s,
            "written_bytes": written, "read_bytes": read}


def summarize(runs: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    out = {}
    for tokens in sizes:
        mine = [r for r in runs if r["tokens"] == tokens]
        med = {k: statistics.median(r[k] for r in mine) for k in
               ("prompt_tokens", "cold_ttft_s", "disk_ttft_s", "ram_ttft_s", "disk_cached_tokens", "restore_s",
                "read_bytes")}
        med["disk_vs_cold"] = med["disk_ttft_s"] / med["cold_ttft_s"]
        med["ram_vs_cold"] = med["ram_ttft_s"] / med["cold_ttft_s"]
        med["cached_fraction"] = med["disk_cached_tokens"] / med["prompt_tokens"]
        out[str(tokens)] = med
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    env, preload = anchor.child_env()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.tokens:
            for run in range(args.runs):
                result = asyncio.run(one_run(args, env, Path(tmp), tokenizer, run, tokens))
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
                runs.append(result)
    summary = summarize(runs, args.tokens)
    print(f"\n{'tokens':>8} {'cold s':>8} {'disk s':>8} {'RAM s':>8} {'disk/cold':>10} {'cached':>8} {'restore s':>10}")
    for tokens, s in summary.items():
        print(f"{tokens:>8} {s['cold_ttft_s']:8.2f} {s['disk_ttft_s']:8.2f} {s['ram_ttft_s']:8.2f} "
              f"{s['disk_vs_cold']:10.3f} {s['cached_fraction']:8.3f} {s['restore_s']:10.3f}")
    biggest = summary[str(max(args.tokens))]
    goal = {"tokens": max(args.tokens), "disk_vs_cold": biggest["disk_vs_cold"], "goal": GOAL_RATIO,
            "pass": biggest["disk_vs_cold"] <= GOAL_RATIO}
    print(f"\ngoal: disk/cold at {goal['tokens']} tokens {goal['disk_vs_cold']:.3f} <= {GOAL_RATIO}: "
          f"{'PASS' if goal['pass'] else 'FAIL'}")
    write_result(args.out, {"model": args.model, "runs": args.runs, "openblas": preload, "host": anchor.host_info(),
                            "summary": summary, "goal": goal, "per_run": runs})
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
