#!/usr/bin/env python3
"""Images side by side: specd against ``mlx_vlm.server`` and vllm-mlx on the same vision-language checkpoint.

The servers are started by this script on free ports of 127.0.0.1, as their users run them
(specd's daemon on a one-Model manifest, at its defaults; ``python -m mlx_vlm.server --model
PATH``, at its defaults: continuous batching; ``vllm-mlx serve PATH --continuous-batching
--mllm``, where ``--vllm-mlx-python`` has it), warmed up with one request each. Then, at each
concurrency, they take turns run by run (the order rotates), so a machine whose speed drifts
slows all alike. One run fires ``c`` streaming chat completions at once, each with an
image of its own (a new PNG every request of a run, the same for every server: a screenshot a
client has not sent before, so no server answers from a cache) and the same question, greedy, at
most ``--max-tokens`` tokens (the servers' outputs agree: their completion tokens are compared in
the JSON); per run:

* aggregate output tokens/s = the completion tokens (each server's own ``usage``) / wall time;
* the median time to the first content chunk (TTFT) of its requests.

A run during which other processes (an idle server polling, another job) used more than
``--max-foreign-cores`` cores is redone, up to ``--retries`` times (``serve_vs_mlx_lm.ForeignLoad``).

Reported per server: the median over runs; the comparisons are specd / each other server.

The model is the forge's (``--family``: Qwen2.5-VL by default, or Gemma 3) with a text half
widened to a small real model's (``WIDTHS``; the vision tower stays tiny), unless ``--model``
names a checkpoint. The forge's LLaVA is not offered: ``mlx_vlm.server`` answers 500 for it
(mlx-vlm issue #870 under transformers 5), and vllm-mlx 0.6.0's multimodal path fails on
mlx-vlm 0.7.10's Gemma 3 (it passes it no attention mask), so only Qwen2.5-VL runs on all three.

Usage (from the repository root)::

    python ops/bench/vision_serve.py --runs 5 --concurrency 1 4 --vllm-mlx-python /tmp/vllm-mlx-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_vs_mlx_lm as anchor  # noqa: E402

TOKENIZER = anchor.REPO_ROOT / "models" / "demo" / "target"
# The forged text halves widened to a small real model's (their vision towers stay tiny)
_WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4}
WIDTHS = {"qwen2_5_vl": {**_WIDE, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},
          "gemma3": {**_WIDE, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512}}
DEFAULT_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "vision_serve.json"
QUESTION = "def describe(image):"  # the demo models learned Python, not chat


def image_url(seed: int, size: tuple[int, int]) -> str:
    """A PNG of its own for each request: a gradient under seeded noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]]
    pixels = np.stack([x * 255 // size[0], y * 255 // size[1], rng.integers(0, 256, size[::-1])], -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def ask(session: aiohttp.ClientSession, base: str, model_id: str, seed: int, args) -> dict:
    """One streaming chat completion with one image; its TTFT, tokens and latency."""
    body = {"model": model_id, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url(seed, tuple(args.image_size))}},
                {"type": "text", "text": QUESTION}]}]}
    started = time.perf_counter()
    ttft, usage, chunks = None, None, 0
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {base}: {await resp.text()}")
        async for event in anchor.sse_events(resp):
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - started
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - started, "chunks": chunks,
            "completion_tokens": int(usage["completion_tokens"]) if usage else chunks,
            "prompt_tokens": int(usage["prompt_tokens"]) if usage else None, "usage_reported": usage is not None}


async def run_once(session, base: str, model_id: str, c: int, seed: int, args, pid: int) -> dict:
    """One run of ``c`` requests, redone while other processes took more than ``--max-foreign-cores``."""
    for attempt in range(1, args.retries + 2):
        load = anchor.ForeignLoad(pid)
        started = time.perf_counter()
        results = await asyncio.gather(*(ask(session, base, model_id, seed + i, args) for i in range(c)))
        wall = time.perf_counter() - started
        foreign = load.cores()
        if foreign is None or foreign <= args.max_foreign_cores:
            break
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {"wall_s": wall, "tokens_per_s": sum(r["completion_tokens"] for r in results) / wall,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None, "foreign_cores": foreign,
            "attempts": attempt, "requests": results}


def mlx_vlm_spec(model: Path, port: int) -> anchor.ServerSpec:
    argv = [sys.executable, "-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    return anchor.ServerSpec("mlx_vlm", argv, "/health", str(model))


def vllm_mlx_spec(model: Path, port: int, python: Path) -> anchor.ServerSpec:
    argv = [str(python), "-m", "vllm_mlx.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", anchor.SPECD_MODEL_ID, "--continuous-batching", "--mllm"]
    return anchor.ServerSpec("vllm_mlx", argv, "/v1/models", anchor.SPECD_MODEL_ID)


async def bench(args, env: dict, workdir: Path) -> dict:
    (workdir / "specd").mkdir()
    starts = [lambda port: anchor.specd_spec(args.model, workdir / "specd", port),
              lambda port: mlx_vlm_spec(args.model, port)]
    if args.vllm_mlx_python is not None:
        starts.append(lambda port: vllm_mlx_spec(args.model, port, args.vllm_mlx_python))
    servers = [(start(port), port) for start, port in ((start, anchor.free_port()) for start in starts)]
    runs: dict[str, dict[str, list]] = {spec.name: {} for spec, _ in servers}
    startup = {}
    timeout = aiohttp.ClientTimeout(total=anchor.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with contextlib.ExitStack() as stack:
            bases, pids = {}, {}
            for spec, p in servers:
                log_path = workdir / f"{spec.name}.log"
                proc = stack.enter_context(anchor.running(spec, env, log_path))
                pids[spec.name] = proc.pid
                ready = await anchor.wait_ready(session, f"http://127.0.0.1:{p}", spec, proc, log_path)
                warm = await ask(session, f"http://127.0.0.1:{p}", spec.model_id, 10**6, args)
                bases[spec.name] = (f"http://127.0.0.1:{p}", spec.model_id)
                startup[spec.name] = {"argv": spec.argv, "ready_s": ready, "warmup": warm}
                print(f"[{spec.name}] ready in {ready:.1f}s, warm-up {warm['latency_s']:.2f}s", flush=True)
            names = [spec.name for spec, _ in servers]
            for c in args.concurrency:
                for r in range(args.runs):
                    seed = 1000 * c + 10 * r  # every server gets the same images in a run: the same work
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        base, model_id = bases[name]
                        result = await run_once(session, base, model_id, c, seed, args, pids[name])
                        runs[name].setdefault(str(c), []).append(result)
                        print(f"[{name}] c={c} run {r}: {result['tokens_per_s']:.1f} tok/s, "
                              f"TTFT {result['ttft_median_s']:.3f}s", flush=True)
            for spec, _ in servers:
                startup[spec.name]["log"] = anchor.log_tail(workdir / f"{spec.name}.log")
    return {"runs": runs, "startup": startup}


def summarize(runs: dict, concurrencies: list[int]) -> dict:
    out = {}
    for c in map(str, concurrencies):
        row = {}
        for name, by_c in runs.items():
            rs = by_c[c]
            row[name] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                         "ttft_s": statistics.median(r["ttft_median_s"] for r in rs),
                         "prompt_tokens": rs[0]["requests"][0]["prompt_tokens"]}
        totals = {name: [sum(q["completion_tokens"] for q in r["requests"]) for r in by_c[c]]
                  for name, by_c in runs.items()}
        row["completion_tokens_per_run"] = totals
        row["same_completion_tokens"] = len({tuple(t) for t in totals.values()}) == 1
        for name in runs:
            if name != "specd":
                row[f"specd_vs_{name}"] = {"tokens_per_s": row["specd"]["tokens_per_s"] / row[name]["tokens_per_s"],
                                          "ttft": row["specd"]["ttft_s"] / row[name]["ttft_s"]}
        out[c] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a vision-language checkpoint (default: the forge's --family at WIDTHS, built here)")
    p.add_argument("--family", choices=sorted(WIDTHS), default="qwen2_5_vl")
    p.add_argument("--vllm-mlx-python", type=Path, default=None,
                   help="an interpreter with vllm-mlx (as agent_replay.py makes one); omitted: two servers")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--image-size", type=int, nargs=2, default=[320, 240], metavar=("W", "H"))
    p.add_argument("--max-foreign-cores", type=float, default=0.5)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    env, preload = anchor.child_env()
    env["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from specd.forge.vision import build

            args.model = build(args.family, Path(tmp) / args.family, TOKENIZER, seed=0,
                               text_overrides=WIDTHS[args.family])
            args.forged = {"family": args.family, "text_overrides": WIDTHS[args.family]}
        result = asyncio.run(bench(args, env, Path(tmp)))
    summary = summarize(result["runs"], args.concurrency)
    names = list(result["runs"])
    print("\n  c " + "".join(f"{n + ' tok/s':>16}{n + ' TTFT':>16}" for n in names))
    for c, row in summary.items():
        print(f"{c:>3} " + "".join(f"{row[n]['tokens_per_s']:>16.1f}{row[n]['ttft_s']:>15.3f}s" for n in names))
        for n in names[1:]:
            ratio = row[f"specd_vs_{n}"]
            print(f"    specd / {n}: tokens/s {ratio['tokens_per_s']:.2f}x, TTFT {ratio['ttft']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "vision_serve", "created_unix": time.time(), "model": str(args.model),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "openblas_preload": preload, "host": anchor.host_info(),
        "versions": {name: anchor.package_version(name) for name in ("mlx", "mlx-lm", "mlx-vlm", "specd")},
        "summary": summary, **result}, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
