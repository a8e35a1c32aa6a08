#!/usr/bin/env python3
"""KV memory of short requests beside a long one, joins, and throughput: specd against mlx_lm.server.

One run, every server on the same random-weight Llama with a realistic KV
width (8 KV heads of 128 dimensions, 4 layers, float32: 32 KiB a token),
prefix caching off everywhere, mlx_lm.server at its defaults otherwise:

1. **Memory of short requests.** One request with a 6,000-token prompt
   decodes; once it streams, seven 100-token requests (160 tokens each)
   join it. The figure is the server's peak RSS minus its peak in the same
   run without the seven, against the seven's live KV (prompt + output
   tokens x 32 KiB). A fresh server per run: peak RSS only grows.
2. **Time to first token of a joining request** while B rows of 2,000
   tokens decode, for B = 1, 2, 4: it should not grow with B x context.
3. **Tokens/s** at 1 and 8 concurrent requests of mixed lengths.
4. **Requests on one system prompt** (prefix caching on, every server's
   own): once a 4,000-token system prompt is cached, eight requests on it
   (each its own 50-token question, 64 tokens out) run at once. The figure
   is the server's peak RSS while they run minus its RSS before them,
   against one copy of the prompt's KV (what eight rows hold if they read
   it in place) and eight copies (if each row holds it).

``--baseline REPO`` adds the specd of another checkout (say, the commit
before a change) as ``specd@base``, run from that directory.

    specd forge models/test --preset test   # the tokenizer the random model uses
    python ops/bench/kv_memory.py [--baseline /tmp/base-checkout]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from transformers import AutoTokenizer

from serve_vs_mlx_lm import (ServerSpec, child_env, free_port, mlx_lm_spec, running, specd_spec, sse_events,
                             wait_ready)
from spec_decode import machine_info, write_result
from specd.forge.families import build

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "kv_memory.json"
REALISTIC = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 2048, "num_hidden_layers": 4, "max_position_embeddings": 16384}
TOKEN_KV_BYTES = 4 * 2 * 8 * 128 * 4  # layers x (keys, values) x heads x dims x float32


def rss_of_tree(pid: int) -> int:
    """Resident bytes of a process and its children."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total


class PeakRSS:
    """Samples a server's RSS every 20 ms while running: the peak of the whole
    run, and of the part since ``mark`` (the long row decoding)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self.since_mark, self._task = pid, 0, 0, None

    def mark(self) -> None:
        self.since_mark = rss_of_tree(self.pid)

    async def __aenter__(self):
        async def sample():
            while True:
                rss = rss_of_tree(self.pid)
                self.peak, self.since_mark = max(self.peak, rss), max(self.since_mark, rss)
                await asyncio.sleep(0.02)
        self._task = asyncio.create_task(sample())
        return self

    async def __aexit__(self, *exc):
        self._task.cancel()
        rss = rss_of_tree(self.pid)
        self.peak, self.since_mark = max(self.peak, rss), max(self.since_mark, rss)


async def complete(session: aiohttp.ClientSession, base: str, model: str, prompt: str, max_tokens: int,
                   first: asyncio.Event | None = None) -> dict:
    """A streamed greedy completion: TTFT, prompt and completion tokens as the server counts them, seconds."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, ttft, tokens, prompt_tokens = time.perf_counter(), None, 0, 0
    async with session.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for event in sse_events(resp):
            if event.get("usage"):
                tokens, prompt_tokens = event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"]
            if any(c.get("text") for c in event.get("choices") or []) and ttft is None:
                ttft = time.perf_counter() - started
                if first is not None:
                    first.set()
    return {"ttft_s": ttft, "tokens": tokens, "prompt_tokens": prompt_tokens, "seconds": time.perf_counter() - started}


TOKENIZER = None  # set in main: prompts are text (mlx_lm.server takes no token ids)


def prompt_of(n: int, seed: int) -> str:
    """About n tokens of text, varied by seed (the server's own count is in each result's usage)."""
    return TOKENIZER.decode([10 + (seed * 7919 + i * 104729) % 1000 for i in range(n)])


async def with_server(spec: ServerSpec, env: dict, workdir: Path, port: int, job) -> dict:
    log = workdir / f"{spec.name}-{port}.log"
    with running(spec, env, log) as proc:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            base = f"http://127.0.0.1:{port}"
            await wait_ready(session, base, spec, proc, log)
            return await job(session, base, spec.model_id, proc.pid)


def memory_job(with_short: bool, long_prompt: int, long_tokens: int):
    async def job(session, base, model, pid):
        await complete(session, base, model, prompt_of(16, 99), 4)  # warm-up
        async with PeakRSS(pid) as peak:
            idle = rss_of_tree(pid)
            streaming = asyncio.Event()
            long = asyncio.create_task(complete(session, base, model, prompt_of(long_prompt, 1), long_tokens,
                                                streaming))
            await streaming.wait()
            peak.mark()  # the long prompt's prefill is done: what follows is decoding, and the joiners
            short = await asyncio.gather(*(complete(session, base, model, prompt_of(100, 10 + i), 160)
                                           for i in range(7 if with_short else 0)))
            await long
        return {"peak_rss": peak.peak, "decode_peak_rss": peak.since_mark, "idle_rss": idle,
                "short_tokens": sum(r["prompt_tokens"] + r["tokens"] for r in short)}
    return job


def join_job(rows: list[int], context: int):
    async def job(session, base, model, pid):
        await complete(session, base, model, prompt_of(16, 99), 4)
        out = {}
        for b in rows:
            started = [asyncio.Event() for _ in range(b)]
            longs = [asyncio.create_task(complete(session, base, model, prompt_of(context, 50 + i), 160, started[i]))
                     for i in range(b)]
            for event in started:
                await event.wait()
            ttfts = [(await complete(session, base, model, prompt_of(100, 200 + j), 8))["ttft_s"] for j in range(3)]
            await asyncio.gather(*longs)
            out[b] = statistics.median(ttfts)
        return out
    return job


def throughput_job(runs: int):
    async def job(session, base, model, pid):
        await complete(session, base, model, prompt_of(16, 99), 4)
        out = {}
        for c in (1, 8):
            rates = []
            for r in range(runs):
                lengths = [100, 400, 1200, 200, 800, 150, 600, 300][:c]
                started = time.perf_counter()
                done = await asyncio.gather(*(complete(session, base, model, prompt_of(n, 300 + r * 8 + i), 128)
                                              for i, n in enumerate(lengths)))
                rates.append(sum(d["tokens"] for d in done) / (time.perf_counter() - started))
            out[c] = statistics.median(rates)
        return out
    return job


def shared_prompt_job(system: int, rows: int):
    async def job(session, base, model, pid):
        prompt = prompt_of(system, 7)
        await complete(session, base, model, prompt + prompt_of(50, 8), 4)  # caches the system prompt
        await asyncio.sleep(0.5)
        before = rss_of_tree(pid)
        async with PeakRSS(pid) as peak:
            done = await asyncio.gather(*(complete(session, base, model, prompt + prompt_of(50, 20 + i), 64)
                                          for i in range(rows)))
        return {"rss_before": before, "peak_rss": peak.peak, "extra_rss": peak.peak - before,
                "prompt_tokens": statistics.median(d["prompt_tokens"] for d in done),
                "ttft_s": statistics.median(d["ttft_s"] for d in done)}
    return job


def servers(model: Path, workdir: Path, baseline: Path | None, prompt_cache: bool = False) -> dict:
    """name -> port -> ServerSpec (a baseline specd imports its own checkout first)."""
    out = {}
    for name, root in [("specd", None)] + ([("specd@base", baseline.resolve())] if baseline else []):
        def make(port, root=root, name=name):
            home = Path(tempfile.mkdtemp(dir=workdir, prefix=name.replace("@", "-")))
            spec = specd_spec(model, home, port, prompt_cache=prompt_cache)
            argv = spec.argv
            if root is not None:  # argv is [python, -m, specd.cli, daemon, ...]
                argv = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r}); "
                        "from specd.cli import main; sys.exit(main())", *argv[3:]]
            return ServerSpec(name, argv, spec.ready_path, spec.model_id)
        out[name] = make
    out["mlx_lm"] = lambda port: mlx_lm_spec(model, port, prompt_cache=prompt_cache, backlog=64)
    return out


async def shared_prompt(args: argparse.Namespace, workdir: Path, model: Path, env: dict) -> dict:
    """Part 4, every server with its prefix cache on."""
    result = {}
    for name, make in servers(model, workdir, args.baseline, prompt_cache=True).items():
        runs = []
        for _ in range(args.memory_runs):
            port = free_port()
            runs.append(await with_server(make(port), env, workdir, port, shared_prompt_job(args.system_prompt, 8)))
        extra = statistics.median(r["extra_rss"] for r in runs)
        prompt_kv = statistics.median(r["prompt_tokens"] for r in runs) * TOKEN_KV_BYTES
        result[name] = {"runs": runs, "extra_rss": extra, "prompt_kv": prompt_kv, "copies": extra / prompt_kv,
                        "ttft_s": statistics.median(r["ttft_s"] for r in runs)}
        print(f"{name}: 8 requests on one cached {args.system_prompt}-token system prompt: peak RSS "
              f"+{extra / 2**20:.0f} MiB, {extra / prompt_kv:.2f}x one copy of the prompt's KV "
              f"({prompt_kv / 2**20:.0f} MiB); median TTFT {result[name]['ttft_s'] * 1000:.0f} ms", flush=True)
    return result


async def bench(args: argparse.Namespace, workdir: Path) -> dict:
    model = build("llama", workdir / "model", args.tokenizer, overrides=REALISTIC)
    result: dict = {}
    env, _ = child_env()
    if args.only_shared_prompt:
        return {"shared_prompt": await shared_prompt(args, workdir, model, env)}
    for name, make in servers(model, workdir, args.baseline).items():
        async def run(job):
            port = free_port()
            return await with_server(make(port), env, workdir, port, job)
        alone, joined = [], []
        for _ in range(args.memory_runs):  # alternating, a fresh server each
            alone.append(await run(memory_job(False, args.long_prompt, args.long_tokens)))
            joined.append(await run(memory_job(True, args.long_prompt, args.long_tokens)))

        def extra(key: str) -> float:
            return statistics.median(j[key] for j in joined) - statistics.median(a[key] for a in alone)
        live = statistics.median(j["short_tokens"] for j in joined) * TOKEN_KV_BYTES
        result[name] = {"alone": alone, "joined": joined, "short_live_kv": live,
                        "short_extra_rss": extra("peak_rss"), "ratio": extra("peak_rss") / live,
                        "short_extra_decode_rss": extra("decode_peak_rss"),
                        "decode_ratio": extra("decode_peak_rss") / live,
                        "join_ttft_s": await run(join_job([1, 2, 4], args.join_context)),
                        "tok_s": await run(throughput_job(args.runs))}
        r = result[name]
        print(f"{name}: short requests' extra peak RSS {r['short_extra_rss'] / 2**20:.0f} MiB "
              f"({r['short_extra_decode_rss'] / 2**20:.0f} MiB while the long row decodes) for "
              f"{live / 2**20:.0f} MiB of live KV ({r['ratio']:.2f}x, {r['decode_ratio']:.2f}x); join TTFT " +
              ", ".join(f"B={b}: {t * 1000:.0f} ms" for b, t in r["join_ttft_s"].items()) +
              f"; tok/s c=1 {r['tok_s'][1]:.1f}, c=8 {r['tok_s'][8]:.1f}", flush=True)
    return {"servers": result, "shared_prompt": await shared_prompt(args, workdir, model, env)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, default=REPO_ROOT / "models" / "test" / "target",
                   help="the forge test preset's target (specd forge models/test --preset test): its tokenizer")
    p.add_argument("--baseline", type=Path, default=None, help="another specd checkout to run as specd@base")
    p.add_argument("--long-prompt", type=int, default=6000)
    p.add_argument("--long-tokens", type=int, default=400)
    p.add_argument("--join-context", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3, help="throughput runs per concurrency")
    p.add_argument("--memory-runs", type=int, default=3, help="runs with and without the short requests")
    p.add_argument("--system-prompt", type=int, default=4000, help="tokens of part 4's shared system prompt")
    p.add_argument("--only-shared-prompt", action="store_true", help="run part 4 alone")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    global TOKENIZER
    TOKENIZER = AutoTokenizer.from_pretrained(str(args.tokenizer))
    with tempfile.TemporaryDirectory(prefix="kv-memory-") as tmp:
        result = asyncio.run(bench(args, Path(tmp)))
    if "servers" in result:
        print("\nthe short requests' extra peak RSS over their live KV (goal: specd <= 1.5x), whole run and while "
              "the long row decodes; medians:")
        for name, r in result["servers"].items():
            print(f"  {name:<12}{r['ratio']:>6.2f}x {r['decode_ratio']:>6.2f}x   tok/s c=1 {r['tok_s'][1]:>7.1f}"
                  f"   c=8 {r['tok_s'][8]:>7.1f}")
    print("\n8 requests on one cached system prompt: extra peak RSS in copies of the prompt's KV "
          "(1: held once; 8: held by every row); medians:")
    for name, r in result["shared_prompt"].items():
        print(f"  {name:<12}{r['copies']:>6.2f}x   TTFT {r['ttft_s'] * 1000:>6.0f} ms")
    write_result(str(args.out), {"machine": machine_info(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
