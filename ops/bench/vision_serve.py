#!/usr/bin/env python3
"""Images side by side: specd against ``mlx_vlm.server`` on the same vision-language checkpoint.

Both servers are started by this script on free ports of 127.0.0.1, as their users run them
(specd's daemon on a one-Model manifest, at its defaults; ``python -m mlx_vlm.server --model
PATH``, at its defaults: continuous batching), warmed up with one request each. Then, at each
concurrency, they take turns run by run (which goes first alternates), so a machine whose speed
drifts slows both alike. One run fires ``c`` streaming chat completions at once, each with an
image of its own (a new PNG every request: a screenshot a client has not sent before, so neither
server answers from a cache) and the same question, greedy, ``--max-tokens`` tokens; per run:

* aggregate output tokens/s = the completion tokens (each server's own ``usage``) / wall time;
* the median time to the first content chunk (TTFT) of its requests.

Reported per server: the median over runs; the comparison is specd / mlx_vlm.

Usage (from the repository root)::

    python ops/bench/vision_serve.py --runs 5 --concurrency 1 4
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
# The forged Gemma 3 widened to a small real model's text half (its vision tower stays tiny):
# mlx_vlm.server cannot serve the forge's LLaVA (mlx-vlm issue #870 under transformers 5).
WIDTHS = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512}
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


async def run_once(session, base: str, model_id: str, c: int, seed: int, args) -> dict:
    started = time.perf_counter()
    results = await asyncio.gather(*(ask(session, base, model_id, seed + i, args) for i in range(c)))
    wall = time.perf_counter() - started
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {"wall_s": wall, "tokens_per_s": sum(r["completion_tokens"] for r in results) / wall,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None, "requests": results}


def mlx_vlm_spec(model: Path, port: int) -> anchor.ServerSpec:
    argv = [sys.executable, "-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    return anchor.ServerSpec("mlx_vlm", argv, "/health", str(model))


async def bench(args, env: dict, workdir: Path) -> dict:
    (workdir / "specd").mkdir()
    port, vlm_port = anchor.free_port(), anchor.free_port()
    specd = anchor.specd_spec(args.model, workdir / "specd", port)
    vlm = mlx_vlm_spec(args.model, vlm_port)
    runs: dict[str, dict[str, list]] = {"specd": {}, "mlx_vlm": {}}
    startup = {}
    timeout = aiohttp.ClientTimeout(total=anchor.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with contextlib.ExitStack() as stack:
            bases = {}
            for spec, p in ((specd, port), (vlm, vlm_port)):
                log_path = workdir / f"{spec.name}.log"
                proc = stack.enter_context(anchor.running(spec, env, log_path))
                ready = await anchor.wait_ready(session, f"http://127.0.0.1:{p}", spec, proc, log_path)
                warm = await ask(session, f"http://127.0.0.1:{p}", spec.model_id, 10**6, args)
                bases[spec.name] = (f"http://127.0.0.1:{p}", spec.model_id)
                startup[spec.name] = {"argv": spec.argv, "ready_s": ready, "warmup": warm}
                print(f"[{spec.name}] ready in {ready:.1f}s, warm-up {warm['latency_s']:.2f}s", flush=True)
            seed = 0
            for c in args.concurrency:
                for r in range(args.runs):
                    order = ["specd", "mlx_vlm"] if r % 2 == 0 else ["mlx_vlm", "specd"]
                    for name in order:
                        base, model_id = bases[name]
                        result = await run_once(session, base, model_id, c, seed, args)
                        seed += c
                        runs[name].setdefault(str(c), []).append(result)
                        print(f"[{name}] c={c} run {r}: {result['tokens_per_s']:.1f} tok/s, "
                              f"TTFT {result['ttft_median_s']:.3f}s", flush=True)
            for spec in (specd, vlm):
                startup[spec.name]["log"] = anchor.log_tail(workdir / f"{spec.name}.log")
    return {"runs": runs, "startup": startup}


def summarize(runs: dict, concurrencies: list[int]) -> dict:
    out = {}
    for c in map(str, concurrencies):
        row = {}
        for name in ("specd", "mlx_vlm"):
            rs = runs[name][c]
            row[name] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                         "ttft_s": statistics.median(r["ttft_median_s"] for r in rs),
                         "prompt_tokens": rs[0]["requests"][0]["prompt_tokens"]}
        row["tokens_per_s_ratio"] = row["specd"]["tokens_per_s"] / row["mlx_vlm"]["tokens_per_s"]
        row["ttft_ratio"] = row["specd"]["ttft_s"] / row["mlx_vlm"]["ttft_s"]
        out[c] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a vision-language checkpoint (default: the forge's Gemma 3 at WIDTHS, built here)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--image-size", type=int, nargs=2, default=[320, 240], metavar=("W", "H"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    env, preload = anchor.child_env()
    env["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from specd.forge.vision import build

            args.model = build("gemma3", Path(tmp) / "gemma3", TOKENIZER, seed=0, text_overrides=WIDTHS)
            args.forged = {"family": "gemma3", "text_overrides": WIDTHS}
        result = asyncio.run(bench(args, env, Path(tmp)))
    summary = summarize(result["runs"], args.concurrency)
    print(f"\n{'c':>3} {'specd tok/s':>12} {'mlx_vlm tok/s':>14} {'ratio':>6} {'specd TTFT':>11} "
          f"{'mlx_vlm TTFT':>13} {'ratio':>6}")
    for c, row in summary.items():
        print(f"{c:>3} {row['specd']['tokens_per_s']:>12.1f} {row['mlx_vlm']['tokens_per_s']:>14.1f} "
              f"{row['tokens_per_s_ratio']:>6.2f} {row['specd']['ttft_s']:>10.3f}s {row['mlx_vlm']['ttft_s']:>12.3f}s "
              f"{row['ttft_ratio']:>6.2f}")
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
