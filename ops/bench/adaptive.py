"""Adaptive speculation benchmark: goodput mode vs spec-off, every static k and the seed policy.

Three workloads (repetitive rewrite, code continuation, adversarial random
tokens) at several concurrencies, on the demo pair with a draft-model
pairing, in process. Concurrency c is c clients, each sending its requests
one after another (at c = 1 several, so a run is more than one request). For
each cell: aggregate output tokens/s (median of runs, taken round-robin over
the configurations so that the machine's slow spells hit every one alike,
each round starting at the next configuration so that none always runs after
the same one) of spec-off, static k = 1..K (no policy: every request
speculates k), the seed policy (``mode: static``) and ``mode: goodput``,
then the ratios goodput/spec-off and goodput/best-static-k (the best by
median, chosen in hindsight). A ratio is the median of the rounds' ratios:
the two configurations of one round ran seconds apart, so the machine's
drift over minutes (tens of percent here) cancels out of it. The seed policy
never speculates at concurrency >= 4 (``disableByBatchSize: 4``), so there
its ratio to spec-off shows the spread of the measurement itself.

    python ops/bench/adaptive.py --pair models/demo [--target-dir target-inflated]

Run with OpenBLAS preloaded (``source ops/env.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
from pathlib import Path
from typing import Any

from specd.core.loader import load_model as load  # as the daemon loads (core.cpu_jit first)
from specd.core.memory import reuse_freed_memory
from specd.engine.engine import Engine
from specd.engine.scheduler import EngineConfig
from specd.core.request import Method, SpeculationConfig
from specd.speculation.config import PolicySettings

from spec_decode import (CODE_PROMPTS, RESULTS, closed_loop, machine_info, rewrite_prompts, serve_clients,
                         write_result)

SEED_POLICY = PolicySettings(mode="static", max_speculative_tokens=4, disable_by_batch_size=4,
                             acceptance_rate_threshold=0.3, ema_alpha=0.1)
GOODPUT_POLICY = PolicySettings(mode="goodput", max_speculative_tokens=4)


def workloads(tokenizer, vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    code = [tokenizer.encode(p) for p in CODE_PROMPTS]
    words = " ".join(CODE_PROMPTS).split()
    shuffled = []
    for _ in range(3):
        rng.shuffle(words)
        shuffled.append(tokenizer.encode(" ".join(words)))
    noise = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(3)]
    return {"repetitive": [tokenizer.encode(p) for p in rewrite_prompts()], "code": code,
            "adversarial": noise + shuffled}


def speculating(k: int) -> SpeculationConfig:
    return SpeculationConfig(Method.DRAFT, k) if k else SpeculationConfig(Method.NONE)


async def serve(engine: Engine, clients: list[list[list[int]]], k: int, max_tokens: int) -> float:
    """Aggregate output tokens/s, every request asking for k draft tokens."""
    return (await serve_clients(engine, clients, [speculating(k)] * len(clients), max_tokens))["tok_s"]


async def set_policy(engine: Engine, policy: PolicySettings | None) -> None:
    engine.set_policy(policy, "bench" if policy else None)
    await asyncio.sleep(0.05)  # applied between steps; the engine is idle here


async def bench(args) -> dict[str, Any]:
    pair = Path(args.pair)
    target, tokenizer = load(str(pair / args.target_dir))
    draft, _ = load(str(pair / "draft"))
    engine = Engine("bench", target, tokenizer, EngineConfig(max_batch_size=32, max_waiting=256),
                    drafter=draft)
    engine.start()
    loads = workloads(tokenizer, target.args.vocab_size)
    configs = [("off", None, 0)] + [(f"k={k}", None, k) for k in range(1, args.max_k + 1)] + \
              [("static-policy", SEED_POLICY, args.max_k), ("goodput", GOODPUT_POLICY, args.max_k)]
    table: dict[str, Any] = {}
    try:
        await set_policy(engine, GOODPUT_POLICY)  # warm-up: let the cost model see every width
        for k in range(args.max_k + 1):
            await serve(engine, [[p] for p in loads["code"][:4]], k, 16)
        for name, prompts in loads.items():
            for conc in args.concurrency:
                batch = closed_loop(prompts, conc, args.min_requests)
                runs: dict[str, list[float]] = {label: [] for label, _, _ in configs}
                for run in range(args.runs):  # round-robin, so a slow spell of the machine hits every config,
                    first = run % len(configs)  # each round starting one later
                    for label, policy, k in configs[first:] + configs[:first]:
                        await set_policy(engine, policy)
                        runs[label].append(await serve(engine, batch, k, args.max_tokens))
                cell = {label: {"tok_s": statistics.median(r), "runs": r} for label, r in runs.items()}
                cell["summary"] = summarise(runs, [label for label, policy, _ in configs if policy is None])
                table.setdefault(name, {})[conc] = cell
                print_cell(name, conc, cell, [c[0] for c in configs])
        costs = engine.scheduler.speculator.feedback.costs.snapshot()
    finally:
        await engine.shutdown(1)
    return {"table": table, "learned_costs": costs}


def summarise(runs: dict[str, list[float]], statics: list[str]) -> dict[str, Any]:
    """A cell's ratios, each the median of per-round ratios with its 90%
    interval, and the best static configuration by median tok/s.  The
    interval says whether a ratio's distance from a goal is more than the
    machine's noise; choosing the best static in hindsight also favours
    whichever static had the luckiest rounds, which it does not cover."""
    best = max(statics, key=lambda label: statistics.median(runs[label]))
    summary: dict[str, Any] = {"best_static": best}
    for name, (config, baseline) in {"goodput_vs_off": ("goodput", "off"),
                                     "goodput_vs_best_static": ("goodput", best),
                                     "static_policy_vs_off": ("static-policy", "off"),
                                     "best_static_vs_off": (best, "off")}.items():
        ratios = [a / b for a, b in zip(runs[config], runs[baseline])]
        summary[name] = statistics.median(ratios)
        summary[f"{name}_ci90"] = median_interval(ratios)
    return summary


def median_interval(values: list[float], level: float = 0.9) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics j
    and n + 1 - j with j the largest for which the binomial tail P(B < j),
    B ~ Bin(n, 1/2), stays within (1 - level) / 2 (20 values: the 6th and
    15th, 95.9% coverage).  Too few values for any such j give the range."""
    ordered, n = sorted(values), len(values)
    tail, j = 0.0, 0
    while j < n // 2 and tail + math.comb(n, j) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, j) / 2 ** n
        j += 1
    j = max(j, 1)
    return ordered[j - 1], ordered[n - j]


def print_cell(workload: str, conc: int, cell: dict, labels: list[str]) -> None:
    s = cell["summary"]
    values = "  ".join(f"{lbl} {cell[lbl]['tok_s']:.0f}" for lbl in labels)
    low_off, high_off = s["goodput_vs_off_ci90"]
    low_best, high_best = s["goodput_vs_best_static_ci90"]
    print(f"{workload:<11} c={conc:<3} {values}  | goodput/off {s['goodput_vs_off']:.2f}x "
          f"[{low_off:.2f}, {high_off:.2f}], goodput/best-static({s['best_static']}) "
          f"{s['goodput_vs_best_static']:.2f}x [{low_best:.2f}, {high_best:.2f}]", flush=True)


def main() -> int:
    reuse_freed_memory()  # the C heap as the daemon sets it (specd/cli.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="models/demo")
    parser.add_argument("--target-dir", default="target")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=4,
                        help="requests per run; below it each of the c clients sends several, one after another")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--out", default=str(RESULTS / "adaptive.json"))
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    worst_off = min(c["summary"]["goodput_vs_off"] for w in result["table"].values() for c in w.values())
    worst_best = min(c["summary"]["goodput_vs_best_static"] for w in result["table"].values() for c in w.values())
    beats = [(w, c) for w, row in result["table"].items() for c, cell in row.items()
             if cell["summary"]["goodput_vs_best_static"] > 1.0]
    print(f"\nworst goodput/off {worst_off:.2f}x (goal >= 0.95), worst goodput/best-static {worst_best:.2f}x "
          f"(goal >= 0.95); goodput beats the best static k at {beats}")
    write_result(args.out, {**machine_info(args), "worst_goodput_vs_off": worst_off,
                            "worst_goodput_vs_best_static": worst_best, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
