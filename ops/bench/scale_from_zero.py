#!/usr/bin/env python3
"""Scale from zero: the first request to an unloaded Model, against the same Model kept loaded.

One daemon per model serves it twice from the same weights: ``cold``
(``scaling.minReplicas: 0``, unloaded after 2 s idle) and ``warm``
(``minReplicas: 1``). For each model, ``--runs`` times: wait until ``cold``
is unloaded, send it a streamed greedy completion (its time to first token
includes placing and loading it), then tokens/s of a 128-token completion on
it, now loaded; then the same two on ``warm``. Medians are reported.

It also measures an engine's memory beyond its budgets (the ``ENGINE_OVERHEAD``
every request counts, ``engine/resources.py``) after short prompts: the daemon's
RSS with ``cold`` loaded and idle (and its peak from the load to the end of its
first requests), minus its RSS with ``cold`` unloaded, minus the weights and
what its KV and prefix caches hold. (What a long prompt's prefill holds beyond
them, MLX's own peak, is ``tests/engine/test_step_memory.py``'s.)

Models: the demo pair (``models/demo``, the target with its draft pairing) and a
random-weight Llama of about 1 GB (float32), built with the test pair's tokenizer.

    specd forge models/test --preset test   # the tokenizer the random model uses
    python ops/bench/scale_from_zero.py [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kv_memory import PeakRSS, complete, rss_of_tree
from serve_vs_mlx_lm import ServerSpec, child_env, free_port, running, wait_ready
from spec_decode import machine_info, write_result
from specd.engine.resources import ENGINE_OVERHEAD, safetensors_bytes
from specd.forge.families import build

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "scale_from_zero.json"
ONE_GB = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
          "intermediate_size": 5632, "num_hidden_layers": 6, "max_position_embeddings": 4096}
PROMPT = "def fibonacci(n):\n    "


def manifests(source: Path, draft: Path | None) -> str:
    docs = []
    for name, scaling in (("cold", "{minReplicas: 0, idleSeconds: 2}"), ("warm", "{minReplicas: 1}")):
        docs.append(f"apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {{name: {name}}}\n"
                    f"spec:\n  source: {source}\n  maxBatchSize: 8\n  scaling: {scaling}\n")
        if draft is not None:
            docs.append(f"apiVersion: specd.dev/v1alpha1\nkind: DraftPairing\nmetadata: {{name: {name}-draft}}\n"
                        f"spec: {{targetRef: {name}, method: draft, source: {draft}, numSpeculativeTokens: 3}}\n")
    return "---\n".join(docs)


async def model_status(session: aiohttp.ClientSession, base: str, name: str) -> dict:
    async with session.get(f"{base}/apis/specd.dev/v1alpha1/models/{name}") as r:
        return (await r.json()).get("status", {})


async def until_idle(session: aiohttp.ClientSession, base: str) -> None:
    deadline = time.monotonic() + 120
    while (await model_status(session, base, "cold")).get("phase") != "Idle":
        if time.monotonic() > deadline:
            raise RuntimeError("cold never went idle")
        await asyncio.sleep(0.2)


async def measure(name: str, source: Path, draft: Path | None, runs: int, workdir: Path) -> dict:
    home = Path(tempfile.mkdtemp(dir=workdir, prefix=name))
    (home / "manifests").mkdir()
    (home / "manifests" / "models.yaml").write_text(manifests(source, draft))
    port = free_port()
    argv = [sys.executable, "-m", "specd.cli", "daemon", "--manifests", str(home / "manifests"),
            "--state-dir", str(home / "state"), "--host", "127.0.0.1", "--port", str(port)]
    spec = ServerSpec("specd", argv, "/readyz", "warm")
    env, _ = child_env()
    base = f"http://127.0.0.1:{port}"
    cold_ttft, warm_ttft, cold_rate, warm_rate, overhead, peak_overhead = [], [], [], [], [], []
    with running(spec, env, home / "daemon.log") as proc:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await wait_ready(session, base, spec, proc, home / "daemon.log")
            await complete(session, base, "warm", PROMPT, 4)
            for _ in range(runs):
                await until_idle(session, base)
                await asyncio.sleep(1.0)  # the unload's memory handed back
                unloaded = rss_of_tree(proc.pid)
                async with PeakRSS(proc.pid) as peak:  # the load and the first requests
                    cold_ttft.append((await complete(session, base, "cold", PROMPT, 16))["ttft_s"])
                    done = await complete(session, base, "cold", PROMPT, 128)
                cold_rate.append(done["tokens"] / done["seconds"])
                status = await model_status(session, base, "cold")  # before it goes idle again
                held = status["kvCache"]["bytes"] + status["prefixCache"]["bytes"]
                requests = status["resources"]["requests"]
                beyond = unloaded + requests["weights"] + requests["drafter"] + held
                overhead.append(rss_of_tree(proc.pid) - beyond)
                peak_overhead.append(peak.peak - beyond)
                warm_ttft.append((await complete(session, base, "warm", PROMPT, 16))["ttft_s"])
                done = await complete(session, base, "warm", PROMPT, 128)
                warm_rate.append(done["tokens"] / done["seconds"])
    weights = safetensors_bytes(source) + (safetensors_bytes(draft) if draft else 0)
    return {"weight_bytes": weights, "runs": runs,
            "cold_ttft_s": statistics.median(cold_ttft), "warm_ttft_s": statistics.median(warm_ttft),
            "cold_tok_s": statistics.median(cold_rate), "warm_tok_s": statistics.median(warm_rate),
            "engine_overhead_bytes": statistics.median(overhead),
            "engine_peak_overhead_bytes": statistics.median(peak_overhead),
            "raw": {"cold_ttft_s": cold_ttft, "warm_ttft_s": warm_ttft, "cold_tok_s": cold_rate,
                    "warm_tok_s": warm_rate, "engine_overhead_bytes": overhead,
                    "engine_peak_overhead_bytes": peak_overhead}}


async def bench(args: argparse.Namespace, workdir: Path) -> dict:
    demo = REPO_ROOT / "models" / "demo"
    big = build("llama", workdir / "one-gb", REPO_ROOT / "models" / "test" / "target", overrides=ONE_GB)
    return {"demo pair": await measure("demo", demo / "target", demo / "draft", args.runs, workdir),
            "random 1 GB": await measure("big", big, None, args.runs, workdir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(bench(args, Path(tmp)))
    print(f"{'model':<12} {'weights':>9} {'TTFT cold':>10} {'TTFT warm':>10} {'tok/s cold':>11} "
          f"{'tok/s warm':>11} {'ratio':>6} {'overhead':>9} {'at peak':>8}")
    for name, r in results.items():
        print(f"{name:<12} {r['weight_bytes'] / 2**20:>7.0f}Mi {r['cold_ttft_s']:>9.2f}s {r['warm_ttft_s']:>9.3f}s "
              f"{r['cold_tok_s']:>11.1f} {r['warm_tok_s']:>11.1f} {r['cold_tok_s'] / r['warm_tok_s']:>5.2f}x "
              f"{r['engine_overhead_bytes'] / 2**20:>7.0f}Mi {r['engine_peak_overhead_bytes'] / 2**20:>6.0f}Mi")
    print(f"(ENGINE_OVERHEAD counted in every request: {ENGINE_OVERHEAD / 2**20:.0f} MiB)")
    write_result(args.out, {**machine_info(args), "results": results})
    print(json.dumps({k: {"cold_ttft_s": round(v["cold_ttft_s"], 3)} for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
