"""EAGLE benchmark: a locally trained head vs the draft model vs n-gram, chain vs tree.

On the demo target, in process, side by side: for each configuration (spec
off, n-gram, the demo's draft model, EAGLE chain, EAGLE trees) and
concurrency, aggregate output tokens/s (median of runs taken round-robin, so
the machine's slow spells hit every configuration alike), the mean
acceptance length (tokens a speculative round yields: 1 + accepted drafts)
and the acceptance rate (accepted / drafted; a tree counts as deep as its
deepest branch).  Greedy decoding, so every configuration's outputs must
equal spec-off's (checked, and once more in a batch mixing the methods).
The engine's drafter is swapped between configurations the way a
DraftPairing change swaps it.

    specd train-eagle --target models/demo/target --out models/demo/eagle
    python ops/bench/eagle.py --pair models/demo --head models/demo/eagle

Run with OpenBLAS preloaded (``source ops/env.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path
from typing import Any

from specd.core.loader import load_model as load  # as the daemon loads (core.cpu_jit first)
from specd.core.memory import reuse_freed_memory
from specd.engine.engine import Engine
from specd.engine.scheduler import EngineConfig
from specd.core.request import Method, SpeculationConfig
from specd.speculation.eagle.checkpoint import load_head

from spec_decode import CODE_PROMPTS, RESULTS, closed_loop, machine_info, serve_clients, write_result


def configs(k: int) -> list[tuple[str, str | None, SpeculationConfig]]:
    """(label, drafter, speculation): drafter None, "draft" or "eagle"."""
    return [("off", None, SpeculationConfig(Method.NONE)),
            (f"ngram k={k}", None, SpeculationConfig(Method.NGRAM, k)),
            (f"draft k={k}", "draft", SpeculationConfig(Method.DRAFT, k)),
            (f"eagle chain k={k}", "eagle", SpeculationConfig(Method.EAGLE, k)),
            (f"eagle chain k={k + 2}", "eagle", SpeculationConfig(Method.EAGLE, k + 2)),
            (f"eagle tree k={k + 1} top3 8", "eagle", SpeculationConfig(Method.EAGLE, k + 1, tree_top_k=3,
                                                                         tree_tokens=8)),
            (f"eagle tree k={k + 2} top4 16", "eagle", SpeculationConfig(Method.EAGLE, k + 2, tree_top_k=4,
                                                                          tree_tokens=16))]


async def use_drafter(engine: Engine, drafter) -> None:
    """Attach a drafter between steps, as a DraftPairing change does."""
    if engine.drafter_module is not drafter:
        engine.configure_speculation(SpeculationConfig(Method.NONE), drafter)
        await asyncio.sleep(0.05)


async def bench(args) -> dict[str, Any]:
    pair = Path(args.pair)
    target, tokenizer = load(str(pair / "target"))
    drafters = {None: None, "draft": load(str(pair / "draft"))[0], "eagle": load_head(args.head, target)}
    engine = Engine("bench", target, tokenizer, EngineConfig(max_batch_size=32, max_waiting=256))
    engine.start()
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS]
    table: dict[str, Any] = {}
    try:
        for label, drafter, spec in configs(args.k):  # warm-up: compile every shape once
            await use_drafter(engine, drafters[drafter])
            await serve_clients(engine, [[p] for p in prompts[:2]], [spec] * 2, 16)
        reference: dict[int, Any] = {}
        for conc in args.concurrency:
            clients = closed_loop(prompts, conc, args.min_requests)
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs(args.k)}
            for _ in range(args.runs):
                for label, drafter, spec in configs(args.k):
                    await use_drafter(engine, drafters[drafter])
                    runs[label].append(await serve_clients(engine, clients, [spec] * conc, args.max_tokens))
            reference[conc] = runs["off"][0]["outputs"]
            cell = {label: {key: statistics.median(r[key] for r in rs) for key in ("tok_s", "acceptance_length",
                                                                                 "acceptance_rate")}
                    | {"identical_to_off": all(r["outputs"] == reference[conc] for r in rs),
                       "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in rs]}
                    for label, rs in runs.items()}
            off = cell["off"]["tok_s"]
            for label in cell:
                cell[label]["vs_off"] = cell[label]["tok_s"] / off
            table[str(conc)] = cell
            print_cell(conc, cell)
        table["mixed"] = await mixed_parity(engine, drafters["eagle"], prompts, args, reference)
    finally:
        await engine.shutdown(1)
    return {"table": table}


async def mixed_parity(engine: Engine, head, prompts: list[list[int]], args, reference: dict) -> dict:
    """Greedy parity in mixed batches: 8 clients, each with another method
    (off, n-gram, EAGLE chains and trees), against the spec-off outputs."""
    if 8 not in reference:
        return {}
    await use_drafter(engine, head)
    specs = [spec for _, drafter, spec in configs(args.k) if drafter != "draft"]
    specs = [specs[i % len(specs)] for i in range(8)]
    clients = [[prompts[i % len(prompts)]] for i in range(8)]
    outputs = (await serve_clients(engine, clients, specs, args.max_tokens))["outputs"]
    same = sum(o == r for o, r in zip(outputs, reference[8]))
    print(f"\nmixed batch (off, n-gram, EAGLE chains and trees together): {same}/8 requests identical to spec off")
    return {"identical": same, "requests": 8}


def print_cell(conc: int, cell: dict) -> None:
    print(f"\nconcurrency {conc}")
    print(f"  {'config':<26} {'tok/s':>8} {'vs off':>7} {'accept len':>11} {'accept rate':>12} {'same as off':>12}")
    for label, row in cell.items():
        print(f"  {label:<26} {row['tok_s']:8.1f} {row['vs_off']:6.2f}x {row['acceptance_length']:11.2f} "
              f"{row['acceptance_rate']:12.2f} {str(row['identical_to_off']):>12}", flush=True)


def main() -> int:
    reuse_freed_memory()  # the C heap as the daemon sets it (specd/cli.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="models/demo")
    parser.add_argument("--head", default="models/demo/eagle")
    parser.add_argument("--k", type=int, default=3, help="draft/n-gram/chain k (the trees go deeper)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=str(RESULTS / "eagle.json"))
    args = parser.parse_args()
    write_result(args.out, {**machine_info(args), **asyncio.run(bench(args))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
