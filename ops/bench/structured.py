#!/usr/bin/env python3
"""Structured output: tokens/s with a ``json_schema`` against no constraint, on specd.

The same streamed greedy ``/v1/chat/completions`` requests (distinct short
questions), with and without ``response_format: json_schema``, at
concurrency 1 and 8, on specd without speculation and with an n-gram
DraftPairing.  The schema is "schema-heavy": long key names, enums and
bounded strings, so much of its output is forced by the grammar (quotes,
keys, separators), which specd proposes in the verify forward of the round
that reaches them (jump-forward) whether or not the request speculates.

Per run: ``tok_s`` is completion tokens over the wall time of the whole
batch of requests; ``decode_tok_s`` leaves each request's first token out
(tokens after the first over the time after it), so the shorter JSON
answers are not charged more prefill per token.  Medians over runs.  The
ratio json/plain is the grammar's cost (goal: at least 0.9) or gain.
mlx_lm.server has no enforced ``response_format`` to compare against.

JSON and free text are different outputs (n-gram speculation, for one,
gains far more on a small model's repetitive free text), so the machinery's
own cost is measured apart, in process: the same prompts with and without a
grammar that allows any text (``/(.|\n)*/``), which leaves the output
unchanged (checked) while every position is masked and checked as for a
schema.

Usage (from the repository root)::

    python ops/bench/structured.py --model models/demo/target --runs 5
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
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

import multiturn
import spec_decode
import serve_vs_mlx_lm as anchor
from spec_decode import write_result

DEFAULT_OUT = anchor.REPO_ROOT / "ops" / "bench" / "results" / "structured.json"
SCHEMA = {"type": "object", "properties": {
    "function_name": {"type": "string", "maxLength": 24},
    "return_type": {"enum": ["int", "str", "list", "dict", "None", "bool"]},
    "parameters": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "parameter_name": {"type": "string", "maxLength": 16},
        "annotation": {"enum": ["int", "str", "list", "dict", "bool"]},
        "has_default_value": {"type": "boolean"}},
        "required": ["parameter_name", "annotation", "has_default_value"], "additionalProperties": False}},
    "raises_exceptions": {"type": "boolean"},
    "complexity_estimate": {"enum": ["constant", "logarithmic", "linear", "quadratic"]}},
    "required": ["function_name", "return_type", "parameters", "raises_exceptions", "complexity_estimate"],
    "additionalProperties": False}
TOPICS = ("parse a config file", "merge two sorted lists", "retry a network call", "cache results",
          "read a CSV file", "validate an email address", "flatten a nested list", "count words",
          "compute a checksum", "walk a directory", "format a date", "split a path")


async def ask(session: aiohttp.ClientSession, base: str, question: str, constrained: bool,
              max_tokens: int) -> dict[str, Any]:
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA}}}
    answer = await multiturn.turn(session, base, anchor.SPECD_MODEL_ID, [{"role": "user", "content": question}],
                                  max_tokens, extra if constrained else None)
    if constrained and answer["finish_reason"] == "stop":
        json.loads(answer["text"])  # a finished constrained answer that does not parse is a failure, not a data point
    return {"tokens": answer["completion_tokens"], "latency_s": answer["latency_s"],
            "ttft_s": answer["ttft_s"] or answer["latency_s"], "cut": answer["finish_reason"] == "length"}


async def run_once(session, base: str, concurrency: int, constrained: bool, max_tokens: int,
                   offset: int) -> dict[str, Any]:
    questions = [f"Describe, as a function signature, a Python function to {TOPICS[(offset + i) % len(TOPICS)]}."
                 for i in range(concurrency)]
    started = time.perf_counter()
    answers = await asyncio.gather(*(ask(session, base, q, constrained, max_tokens) for q in questions))
    wall = time.perf_counter() - started
    tokens = sum(a["tokens"] for a in answers)
    after_first = sum(a["tokens"] - 1 for a in answers)
    decode_s = max(a["latency_s"] for a in answers) - min(a["ttft_s"] for a in answers)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "decode_tok_s": after_first / decode_s,
            "mean_tokens": tokens / concurrency, "cut_at_max_tokens": sum(a["cut"] for a in answers)}


async def bench_server(spec: anchor.ServerSpec, port: int, env: dict, workdir: Path, args) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}"
    log_path = workdir / f"{spec.name}.log"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=anchor.REQUEST_TIMEOUT_S),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        with anchor.running(spec, env, log_path) as proc:
            await anchor.wait_ready(session, base, spec, proc, log_path)
            for constrained in (False, True):  # warm-up: the grammar tokenizer is built on first use
                await ask(session, base, "Describe a function.", constrained, 16)
            out: dict[str, Any] = {}
            for c in args.concurrency:
                for mode in ("plain", "json"):
                    runs = []
                    for r in range(args.runs):
                        run = await run_once(session, base, c, mode == "json", args.max_tokens, r * c)
                        runs.append(run)
                        print(f"[{spec.name}] c={c} {mode:5} run {r + 1}: {run['tok_s']:6.1f} tok/s, "
                              f"decode {run['decode_tok_s']:6.1f} tok/s, {run['mean_tokens']:.0f} tokens/request",
                              flush=True)
                    out[f"c{c}_{mode}"] = {"runs": runs, **{key: statistics.median(r[key] for r in runs)
                                                            for key in ("tok_s", "decode_tok_s", "mean_tokens")}}
                plain, constrained = out[f"c{c}_plain"], out[f"c{c}_json"]
                out[f"c{c}_ratio"] = {key: constrained[key] / plain[key] for key in ("tok_s", "decode_tok_s")}
            metrics = await (await session.get(base + "/metrics")).text()
            out["forced_tokens_total"] = sum(
                sample.value for family in text_string_to_metric_families(metrics) for sample in family.samples
                if sample.name == "specd_grammar_forced_tokens_total")
    return out


async def bench(args, env: dict, workdir: Path) -> dict[str, Any]:
    results = {}
    for name, ngram in (("specd", False), ("specd_ngram", True)):
        port = anchor.free_port()
        serverdir = workdir / name
        serverdir.mkdir()
        spec = anchor.specd_spec(Path(args.model).resolve(), serverdir, port, ngram=ngram)
        spec.name = name
        results[name] = await bench_server(spec, port, env, serverdir, args)
    return results


def mask_overhead(model_path: str, concurrency: list[int], runs: int, max_tokens: int) -> dict[str, Any]:
    """tok/s with an allow-anything grammar against none, same prompts, in one engine."""
    from specd.core.grammar import lark_grammar
    from specd.core.loader import load_model
    from specd.core.memory import reuse_freed_memory
    from specd.core.request import NO_SPECULATION, SpeculationConfig
    from specd.engine.engine import Engine
    from specd.engine.scheduler import EngineConfig

    reuse_freed_memory()  # the C heap as the daemon sets it (specd/cli.py)
    model, tokenizer = load_model(model_path)
    anything = lark_grammar("start: /(.|\\n)*/")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Write Python to {t}."}],
                                             add_generation_prompt=True) for t in TOPICS]

    async def go() -> dict[str, Any]:
        engine = Engine("bench", model, tokenizer, EngineConfig(max_batch_size=16))
        engine.start()
        out: dict[str, Any] = {}
        try:
            for spec_name, spec in (("plain", NO_SPECULATION), ("ngram", SpeculationConfig("ngram", 3, 1, 4))):
                for c in concurrency:
                    clients = [[p] for p in prompts[:c]]
                    rates: dict[str, list[float]] = {"none": [], "grammar": []}
                    same = True
                    for _ in range(runs):
                        free = await spec_decode.serve_clients(engine, clients, [spec] * c, max_tokens)
                        masked = await spec_decode.serve_clients(engine, clients, [spec] * c, max_tokens, anything)
                        rates["none"].append(free["tok_s"])
                        rates["grammar"].append(masked["tok_s"])
                        same &= free["outputs"] == masked["outputs"]
                    none, grammar = statistics.median(rates["none"]), statistics.median(rates["grammar"])
                    out[f"{spec_name}_c{c}"] = {"none_tok_s": none, "grammar_tok_s": grammar,
                                                "ratio": grammar / none, "same_tokens": same}
                    print(f"[mask overhead] {spec_name} c={c}: {none:6.1f} -> {grammar:6.1f} tok/s "
                          f"({grammar / none:.2f}x), same tokens: {same}", flush=True)
        finally:
            await engine.shutdown(1)
        return out
    return asyncio.run(go())


def print_table(results: dict[str, Any], concurrency: list[int]) -> None:
    print("\nserver        c   plain tok/s  json tok/s  ratio | plain decode  json decode  ratio | tokens plain/json")
    for name, out in results.items():
        for c in concurrency:
            p, j, r = out[f"c{c}_plain"], out[f"c{c}_json"], out[f"c{c}_ratio"]
            print(f"{name:12} {c:2} {p['tok_s']:12.1f} {j['tok_s']:11.1f} {r['tok_s']:6.2f}x | "
                  f"{p['decode_tok_s']:12.1f} {j['decode_tok_s']:12.1f} {r['decode_tok_s']:6.2f}x | "
                  f"{p['mean_tokens']:.0f}/{j['mean_tokens']:.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(anchor.REPO_ROOT / "models" / "demo" / "target"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    env, preload = anchor.child_env()
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(bench(args, env, Path(tmp)))
    overhead = mask_overhead(args.model, args.concurrency, args.runs, args.max_tokens)
    print_table(results, args.concurrency)
    print("\nthe grammar machinery alone (allow-anything grammar, same output):")
    for key, row in overhead.items():
        print(f"  {key:10} {row['none_tok_s']:7.1f} -> {row['grammar_tok_s']:7.1f} tok/s  {row['ratio']:.2f}x  "
              f"same tokens: {row['same_tokens']}")
    write_result(args.out, {"model": args.model, "runs": args.runs, "max_tokens": args.max_tokens,
                            "schema": SCHEMA, "openblas": preload, "host": anchor.host_info(),
                            "results": results, "mask_overhead": overhead})
    return 0


if __name__ == "__main__":
    sys.exit(main())
