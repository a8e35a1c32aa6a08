#!/usr/bin/env python3
"""Multi-turn chat and agent traffic: specd against ``mlx_lm.server`` at its defaults.

Chat and agent clients resend their whole history with every request, so a
server that caches prompt prefixes prefills only what is new.  Two workloads,
streamed greedy ``/v1/chat/completions`` requests on the same model:

* **chat**: every conversation opens with the same system prompt (about
  1,500 tokens of Python source), then six turns of a short question and a
  reply of up to 32 tokens, each turn resending the history;
* **agent**: a system prompt with a long fixed tool list (about 1,100 tokens
  of JSON schemas), then six steps, each sending the reply back with a tool
  result of about 80 tokens, so the history grows by about 120 tokens a step
  (the demo model's context window is 2,048 tokens; the last step is near it);
* **session** (only when asked: ``--workloads session``, on a model with a long
  window such as the forge's ``models/demo/agent``): one long agent session,
  the tool list, then 40 steps each with a tool result of about 350 tokens of
  Python source, so the history passes 14,000 tokens. Its figure of note is the
  time per output token of the last 10 steps, which a server whose decoding
  slows with the number of turns in the history shows. Its requests turn the
  model's thinking off (``chat_template_kwargs``, which both servers take), so
  replies are content that the next step resends, as a Qwen3 agent's are.

Each run plays ``c`` conversations at once (c = 1 and 4); every run asks new
questions (only the system prompt repeats across runs, as in production).
Per run we record each turn's time to first content and each conversation's
wall time.  The servers run side by side and take each run in turn, so each
run has the other servers' runs beside it.  Figures are medians over runs;
TTFT is that of every turn but the first; ``paired`` is the median of each run's ratio to
mlx_lm's run of the same round, which the wall-time goal is judged on.
``mlx_lm.server`` runs at its defaults: batching on (``--decode-concurrency
32 --prompt-concurrency 8``, passed explicitly) and its LRU prompt cache on.
specd runs with its defaults too (prefix cache on), and again with an n-gram
DraftPairing (``specd_ngram``: speculation, which the other server lacks);
its hit rate and cache bytes come from its own ``/metrics``.

Usage (from the repository root)::

    python ops/bench/multiturn.py --model models/demo/target --runs 5
    python ops/bench/multiturn.py --model models/demo/agent --workloads session --concurrency 1 \
        --runs 2 --out ops/bench/results/multiturn_session.json
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
from functools import partial
from pathlib import Path
from typing import Any, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

import serve_vs_mlx_lm as anchor
from spec_decode import write_result

DEFAULT_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "multiturn.json"
TURNS = 6
SESSION_TURNS = 40
EXTRA = {"session": {"chat_template_kwargs": {"enable_thinking": False}}}  # request fields by workload
FUNCTIONS = ("parse", "format", "load", "dump", "split", "join", "update", "read", "write", "close",
             "open", "flush", "encode", "decode", "match", "search")


def system_prompt(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of Python source (the demo model's own kind of text)."""
    import inspect
    import json.decoder
    import json.encoder
    source = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    ids = tokenizer.encode(source)[:tokens]
    return "You are a code assistant. The code under discussion:\n" + tokenizer.decode(ids)


def tool_list(tokenizer, tokens: int) -> str:
    """A system prompt listing tools as JSON schemas, about ``tokens`` tokens long."""
    tools, text = [], ""
    for i in range(200):
        name = f"{FUNCTIONS[i % len(FUNCTIONS)]}_{i}"
        tools.append({"type": "function", "function": {
            "name": name, "description": f"Run {name} on a file of the repository and return what it prints.",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "a path relative to the repository root"},
                "limit": {"type": "integer", "description": "the most lines to return"}},
                "required": ["path"]}}})
        text = "You can call these tools:\n" + json.dumps(tools, indent=1)
        if len(tokenizer.encode(text)) >= tokens:
            break
    return text


def chat_turns(run: int, conv: int) -> list[str]:
    return [f"Q{run}.{conv}.{t}: what does {FUNCTIONS[(run + conv * 3 + t) % len(FUNCTIONS)]} do here?"
            for t in range(TURNS)]


def agent_turns(run: int, conv: int) -> list[str]:
    """The task, then a tool result (about 80 tokens) per step."""
    out = [f"Task {run}.{conv}: find where the decoder handles escapes and fix the bug."]
    for t in range(1, TURNS):
        lines = "\n".join(f"    {t}.{i}: if ch == '\\\\': chunks.append(_decode_{t}_{i}(s, end))" for i in range(3))
        out.append(f"Tool result (run {run}, conversation {conv}, step {t}):\n{lines}")
    return out


def session_turns(run: int, conv: int) -> list[str]:
    """The task, then a tool result of about 350 tokens of Python source per step."""
    import ast
    import inspect
    import json.decoder
    import json.encoder
    source = "".join(inspect.getsource(m) for m in (json.decoder, json.encoder, argparse, ast)) * 3
    first = (run * 7 + conv) * 1100
    return [f"Task {run}.{conv}: read the parser and fix the bug."] + [
        f"Tool result (step {t}):\n{source[first + t * 1100:first + (t + 1) * 1100]}" for t in range(1, SESSION_TURNS)]


def tpot(turn: dict[str, Any]) -> float | None:
    """A turn's seconds per output token after its first."""
    if turn["ttft_s"] is None or not turn["completion_tokens"] or turn["completion_tokens"] < 2:
        return None
    return (turn["latency_s"] - turn["ttft_s"]) / (turn["completion_tokens"] - 1)


async def turn(session: aiohttp.ClientSession, base: str, model_id: str, messages: list[dict],
               max_tokens: int, extra: dict | None = None) -> dict[str, Any]:
    """One streamed greedy chat completion (``extra``: more body fields): its TTFT, text, usage and finish."""
    body = {"model": model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    started = time.perf_counter()
    ttft, parts, usage, finish = None, [], None, None
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {base}: {await resp.text()}")
        async for event in anchor.sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"stream error from {base}: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    parts.append(text)
                    if ttft is None:
                        ttft = time.perf_counter() - started
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - started, "text": "".join(parts),
            "finish_reason": finish, "completion_tokens": (usage or {}).get("completion_tokens"),
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}


async def conversation(session, base: str, model_id: str, system: str, users: list[str],
                       max_tokens: int, extra: dict | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    started = time.perf_counter()
    turns = []
    for user in users:
        messages.append({"role": "user", "content": user})
        result = await turn(session, base, model_id, messages, max_tokens, extra)
        messages.append({"role": "assistant", "content": result["text"]})
        turns.append(result)
    return {"wall_s": time.perf_counter() - started, "turns": turns}


async def measure(specs: dict[str, tuple[anchor.ServerSpec, int]], env: dict[str, str], workdir: Path,
                  workloads: dict[str, tuple[str, Callable[[int, int], list[str]]]],
                  concurrencies: list[int], runs: int, max_tokens: int) -> dict[str, dict[str, Any]]:
    """Start every server, then play every workload at every concurrency ``runs`` times, the
    servers taking each run in turn (each going first in turn): this machine's speed drifts by
    more than the differences measured between spells of a minute, so a run is compared with the
    other servers' runs beside it. Every server plays the same questions in a round."""
    out: dict[str, dict[str, Any]] = {name: {"argv": spec.argv, "workloads": {}} for name, (spec, _) in specs.items()}
    bases = {name: f"http://127.0.0.1:{port}" for name, (_, port) in specs.items()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=anchor.REQUEST_TIMEOUT_S),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        with contextlib.ExitStack() as stack:
            for name, (spec, _) in specs.items():
                log_path = workdir / f"{name}.log"
                proc = stack.enter_context(anchor.running(spec, env, log_path))
                out[name]["ready_s"] = await anchor.wait_ready(session, bases[name], spec, proc, log_path)
                await turn(session, bases[name], spec.model_id, [{"role": "user", "content": "warm up"}], max_tokens)
            run_id = 0
            order = list(specs)
            for name, (system, users) in workloads.items():
                for c in concurrencies:
                    for _ in range(runs):
                        run_id += 1
                        order = order[1:] + order[:1]
                        for server in order:
                            spec = specs[server][0]
                            started = time.perf_counter()
                            convs = await asyncio.gather(*(conversation(session, bases[server], spec.model_id,
                                                                        system, users(run_id, i), max_tokens,
                                                                        EXTRA.get(name))
                                                           for i in range(c)))
                            result = {"wall_s": time.perf_counter() - started, "round": run_id, "conversations": convs}
                            out[server]["workloads"].setdefault(name, {}).setdefault(str(c), []).append(result)
                            later = [t["ttft_s"] for cv in convs for t in cv["turns"][1:] if t["ttft_s"] is not None]
                            print(f"[{server}] {name} c={c}: wall {result['wall_s']:.2f}s, "
                                  f"later-turn TTFT {statistics.median(later) * 1000:.0f} ms", flush=True)
            for server in specs:
                if server.startswith("specd"):
                    async with session.get(bases[server] + "/metrics") as resp:
                        out[server]["metrics"] = prefix_metrics(await resp.text())
        for server in specs:
            out[server]["log"] = anchor.log_tail(workdir / f"{server}.log")
    return out


def prefix_metrics(text: str) -> dict[str, float]:
    """specd's prefix-cache series, read with Prometheus' own parser."""
    wanted = {"specd_prefix_cache_queries_total", "specd_prefix_cache_hits_total", "specd_prefix_cache_bytes",
              "specd_prefix_cache_max_bytes"}
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = sample.value
    queries = values.get("specd_prefix_cache_queries_total")
    values["hit_rate"] = values.get("specd_prefix_cache_hits_total", 0) / queries if queries else None
    return values


def conversation_wall(run: dict[str, Any]) -> float:
    """A run's median conversation wall time."""
    return statistics.median(cv["wall_s"] for cv in run["conversations"])


def summarize(results: dict[str, Any], concurrencies: list[int], servers: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in results["specd"]["workloads"]:
        for c in concurrencies:
            row = {}
            for server in servers:
                runs = results[server]["workloads"][name][str(c)]
                row[server] = {
                    "later_ttft_ms": statistics.median(
                        statistics.median(t["ttft_s"] for cv in run["conversations"] for t in cv["turns"][1:]
                                          if t["ttft_s"] is not None) for run in runs) * 1000,
                    "conversation_wall_s": statistics.median(conversation_wall(run) for run in runs),
                    "run_wall_s": statistics.median(run["wall_s"] for run in runs),
                    "last_turns_tpot_ms": statistics.median(
                        statistics.median(x for cv in run["conversations"] for t in cv["turns"][-10:]
                                          if (x := tpot(t)) is not None) for run in runs) * 1000}
            ratios = {}
            anchor_runs = results["mlx_lm"]["workloads"][name][str(c)]
            for server in servers[:-1]:
                ratio = {k: row[server][k] / row["mlx_lm"][k]
                         for k in ("later_ttft_ms", "conversation_wall_s", "run_wall_s", "last_turns_tpot_ms")}
                # each run over mlx_lm's run of the same round (the runs beside it), then their median
                ratio["paired_conversation_wall"] = statistics.median(
                    conversation_wall(run) / conversation_wall(base)
                    for run, base in zip(results[server]["workloads"][name][str(c)], anchor_runs))
                ratios[server] = {**ratio, "goal": {"later_ttft<=0.5x": ratio["later_ttft_ms"] <= 0.5,
                                                    "wall<=0.8x": ratio["paired_conversation_wall"] <= 0.8}}
            summary[f"{name} c={c}"] = {**row, "over_mlx_lm": ratios}
    return summary


def print_table(summary: dict[str, Any], servers: list[str], metrics: dict[str, dict]) -> None:
    ours = servers[:-1]
    print(f"\n{'workload':<12} {'':<19}" + "".join(f"{s:>12}" for s in servers)
          + "".join(f"{s + '/mlx_lm':>20}" for s in ours))
    for key, row in summary.items():
        for label, field, unit in (("TTFT later turns ms", "later_ttft_ms", "ms"),
                                   ("conversation wall s", "conversation_wall_s", "s"),
                                   ("run wall s", "run_wall_s", "s"),
                                   ("TPOT last 10 ms", "last_turns_tpot_ms", "ms")):
            fmt = "{:>12.1f}" if unit == "ms" else "{:>12.2f}"
            print(f"{key:<12} {label:<19}" + "".join(fmt.format(row[s][field]) for s in servers)
                  + "".join(f"{row['over_mlx_lm'][s][field]:>19.2f}x" for s in ours))
        print(f"{key:<12} {'conv. wall, paired':<19}" + " " * 12 * len(servers)
              + "".join(f"{row['over_mlx_lm'][s]['paired_conversation_wall']:>19.2f}x" for s in ours))
    for server in ours:
        m = metrics.get(server, {})
        if m.get("hit_rate") is not None:
            print(f"{server} prefix cache: hit rate {m['hit_rate']:.3f}, "
                  f"{m.get('specd_prefix_cache_bytes', 0) / 2**20:.1f} MiB held "
                  f"(budget {m.get('specd_prefix_cache_max_bytes', 0) / 2**30:.1f} GiB)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=anchor.DEFAULT_MODEL)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--tool-tokens", type=int, default=1100)
    p.add_argument("--workloads", nargs="+", default=["chat", "agent"], choices=["chat", "agent", "session"])
    p.add_argument("--mlx-lm-backlog", type=int, default=64, help="see serve_vs_mlx_lm.py (0: the stock server)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specd.core.loader import load_tokenizer
    tokenizer = load_tokenizer(str(args.model))
    workloads = {"chat": (system_prompt(tokenizer, args.system_tokens), chat_turns),
                 "agent": (tool_list(tokenizer, args.tool_tokens), agent_turns),
                 "session": (tool_list(tokenizer, args.tool_tokens), session_turns)}
    workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    env, preload = anchor.child_env()
    results: dict[str, Any] = {
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "system_prompt_tokens": {k: len(tokenizer.encode(s)) for k, (s, _) in workloads.items()},
                   "turns": {k: len(users(0, 0)) for k, (_, users) in workloads.items()}, "mlx_lm": "defaults (batching, prompt cache on)", "specd": "defaults (prefix cache on)"},
        "host": anchor.host_info(), "openblas_preload": preload,
        "versions": {p: anchor.package_version(p) for p in ("mlx", "mlx-lm", "specd")}}
    with tempfile.TemporaryDirectory(prefix="multiturn-") as tmp:
        workdir = Path(tmp)
        builds = {"specd": partial(anchor.specd_spec, args.model, workdir / "specd"),
                  "specd_ngram": partial(anchor.specd_spec, args.model, workdir / "specd_ngram", ngram=True),
                  "mlx_lm": partial(anchor.mlx_lm_spec, args.model, prompt_cache=True, backlog=args.mlx_lm_backlog)}
        specs = {}
        for name, build in builds.items():
            (workdir / name).mkdir()
            port = anchor.free_port()
            specs[name] = build(port), port
            specs[name][0].name = name
        results.update(asyncio.run(measure(specs, env, workdir, workloads, args.concurrency,
                                           args.runs, args.max_tokens)))
    servers = list(builds)
    results["summary"] = summarize(results, args.concurrency, servers)
    print_table(results["summary"], servers, {s: results[s].get("metrics", {}) for s in servers})
    write_result(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
