#!/usr/bin/env python3
"""Time to first token of fresh long prompts: specd against ``mlx_lm.server``, taken in turn.

A random-weight Llama with a 16k window and a realistic attention width (8
heads of 128 dimensions: 32 KiB of KV a token in float32, the shape of
``kv_memory.py``), or the model ``--model`` names, is served by both, each as its users run it (prefix and
prompt caches on). At each prompt length (about 2k, 8k and 16k tokens) the
servers take turns run by run, each run a prompt no earlier request shared a
token with (so neither cache can hit): the figure is the wall time of a
one-token completion, which is its time to first token, and the comparison is
specd's median over ``mlx_lm.server``'s (goal: <= 1.0x at every length).

    specd forge models/test --preset test   # the tokenizer the random model uses
    python ops/bench/prefill.py [--lengths 2000 8000 16000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from transformers import AutoTokenizer

from kv_memory import REALISTIC
from serve_vs_mlx_lm import REQUEST_TIMEOUT_S, child_env, free_port, mlx_lm_spec, specd_spec, start_server
from spec_decode import machine_info, write_result
from specd.forge.families import build

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "prefill.json"


def fresh_prompt(tokenizer, length: int, seed: int) -> str:
    """Text of about ``length`` tokens whose first token differs for every seed below 1000 (decoded
    ids re-encode to other ids, so the text is cut to ``length`` of its own tokens, twice)."""
    text = tokenizer.decode([10 + (seed + i * 104729) % 1000 for i in range(length)])
    for _ in range(2):
        text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:length])
    return text


async def first_token_seconds(session: aiohttp.ClientSession, base: str, model: str, prompt: str) -> dict:
    """A one-token greedy completion: its wall time, and the prompt tokens the server counted."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    async with session.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {base}: {await resp.text()}")
        usage = (await resp.json())["usage"]
    return {"seconds": time.perf_counter() - started, "prompt_tokens": usage["prompt_tokens"]}


async def bench(args: argparse.Namespace, workdir: Path) -> dict:
    if args.model is None:
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        model = build("llama", workdir / "model", args.tokenizer, overrides=REALISTIC)
    else:
        tokenizer, model = AutoTokenizer.from_pretrained(str(args.model)), args.model.resolve()
    env, _ = child_env()
    ports: list[int] = []
    while len(ports) < 2:
        if (port := free_port()) not in ports:
            ports.append(port)
    (workdir / "specd").mkdir()
    specs = [specd_spec(model, workdir / "specd", ports[0]), mlx_lm_spec(model, ports[1], True, 64)]
    runs: dict[str, dict[str, list[dict]]] = {spec.name: {} for spec in specs}
    seeds = iter(range(1000))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with contextlib.ExitStack() as stack:
            servers = [await start_server(stack, session, spec, port, env, workdir, 4)
                       for spec, port in zip(specs, ports)]
            for length in args.lengths:
                for r in range(args.runs):
                    for server in (servers if r % 2 == 0 else servers[::-1]):
                        prompt = fresh_prompt(tokenizer, length, next(seeds))
                        run = await first_token_seconds(session, server.base, server.spec.model_id, prompt)
                        runs[server.spec.name].setdefault(str(length), []).append(run)
                        print(f"[{server.spec.name}] {run['prompt_tokens']} prompt tokens: "
                              f"{run['seconds'] * 1000:.0f} ms to the first token", flush=True)
    summary = {}
    for length in map(str, args.lengths):
        medians = {name: statistics.median(r["seconds"] for r in by[length]) for name, by in runs.items()}
        summary[length] = {**{f"{name}_s": s for name, s in medians.items()},
                           "prompt_tokens": {name: by[length][0]["prompt_tokens"] for name, by in runs.items()},
                           "ratio": medians["specd"] / medians["mlx_lm"]}
    return {"runs": runs, "summary": summary,
            "goal": {"ratio_at_most": 1.0, "pass": all(row["ratio"] <= 1.0 for row in summary.values())}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, default=REPO_ROOT / "models" / "test" / "target",
                   help="the forge test preset's target (specd forge models/test --preset test): its tokenizer")
    p.add_argument("--model", type=Path, default=None,
                   help="serve this mlx-lm model directory instead (its own tokenizer), e.g. the demo target")
    p.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000, 16000])
    p.add_argument("--runs", type=int, default=3, help="runs per length and server (medians)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="prefill-") as tmp:
        result = asyncio.run(bench(args, Path(tmp)))
    print(f"\n{'prompt':>8} {'specd':>10} {'mlx_lm':>10} {'specd/mlx_lm':>13}   (time to first token, medians)")
    for length, row in result["summary"].items():
        print(f"{length:>8} {row['specd_s'] * 1000:>8.0f}ms {row['mlx_lm_s'] * 1000:>8.0f}ms {row['ratio']:>12.2f}x")
    print(f"goal: <= 1.0x at every length -> {'PASS' if result['goal']['pass'] else 'FAIL'}")
    write_result(str(args.out), {"machine": machine_info(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
