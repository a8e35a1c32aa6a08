"""Each decoder layer started on the CPU stream as it is built (``specd.core.dispatch``) against a
forward built whole and then evaluated, in turn.

One process, one engine, the two arms switched run by run (``dispatch.forwards`` in place or not;
each ratio is to the run beside it: this machine's speed drifts by more than the differences
measured). It measures:

1. the engine serving greedy code completions in process: spec-off at one and at eight clients,
   and the draft pairing at eight, at a forced k=3 and under its goodput default, with each
   speculating configuration's ratio to spec-off under each arm;
2. time to first token of fresh prompts (random tokens, no prefix cache hit) of ``--prompt``
   tokens, one at a time: prefill chunks run through the same forwards.

    python ops/bench/layer_dispatch.py --pair models/demo --runs 10

Run with OpenBLAS preloaded (``source ops/env.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from typing import Any

from cpu_fast import paired, served_in_turn, serving_configs
from spec_decode import machine_info, write_result
from specd.core import dispatch
from specd.core.loader import load_model as load  # installs the dispatching layers, as the daemon loads
from specd.core.request import GenerationRequest, Method, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.engine.engine import Engine
from specd.engine.scheduler import EngineConfig

ARMS = ("dispatched", "built whole")
FORWARDS = dispatch.forwards


def use(arm: str) -> None:
    dispatch.forwards = FORWARDS if arm == "dispatched" else contextlib.nullcontext


async def serving(engine: Engine, tokenizer, runs: int, max_tokens: int) -> dict[str, Any]:
    configs = serving_configs(tokenizer)
    prompts, _, _, clients = configs["spec-off c=8"]
    configs["draft k=3 c=8"] = (prompts, SpeculationConfig(Method.DRAFT, 3), None, clients)
    tok_s = await served_in_turn(engine, configs, ARMS, use, runs, max_tokens)
    result: dict[str, Any] = {}
    for name in configs:
        result[name] = {**{f"{arm}_tok_s": statistics.median(tok_s[(name, arm)]) for arm in ARMS},
                        "dispatched_over_whole": paired(tok_s[(name, "dispatched")], tok_s[(name, "built whole")])}
        print(f"{name:18} built whole {result[name]['built whole_tok_s']:7.1f} tok/s, dispatched "
              f"{result[name]['dispatched_tok_s']:7.1f} tok/s, paired {result[name]['dispatched_over_whole']:.3f}")
    for name in ("draft k=3 c=8", "draft goodput c=8"):
        ratios = {arm: paired(tok_s[(name, arm)], tok_s[("spec-off c=8", arm)]) for arm in ARMS}
        result[f"{name} over spec-off c=8"] = ratios
        print(f"{name} / spec-off c=8: " + ", ".join(f"{arm} {ratio:.3f}" for arm, ratio in ratios.items()))
    return result


async def first_token_ms(engine: Engine, prompt: list[int]) -> float:
    request = GenerationRequest(f"prefill-{random.random()}", prompt, SamplingParams(temperature=0), 1)
    started = time.perf_counter()
    async for _ in engine.generate(request):
        break
    return (time.perf_counter() - started) * 1000


async def prefill(engine: Engine, tokenizer, runs: int, length: int) -> dict[str, Any]:
    rng = random.Random(0)
    vocab = len(tokenizer.get_vocab())
    ms: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for run in range(runs + 1):
        for arm in (ARMS if run % 2 else ARMS[::-1]):
            use(arm)
            took = await first_token_ms(engine, [rng.randrange(3, vocab) for _ in range(length)])
            if run:
                ms[arm].append(took)
    result = {**{f"{arm}_ms": statistics.median(v) for arm, v in ms.items()},
              "dispatched_over_whole": paired(ms["dispatched"], ms["built whole"])}
    print(f"first token of {length} fresh tokens: built whole {result['built whole_ms']:.0f} ms, dispatched "
          f"{result['dispatched_ms']:.0f} ms, paired {result['dispatched_over_whole']:.3f}")
    return result


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    target, tokenizer = load(f"{args.pair}/target")
    draft, _ = load(f"{args.pair}/draft")
    engine = Engine("bench", target, tokenizer, EngineConfig(max_batch_size=16), drafter=draft)
    engine.start()
    try:
        result = {"serving": await serving(engine, tokenizer, args.runs, args.max_tokens),
                  "prefill": await prefill(engine, tokenizer, args.runs, args.prompt)}
    finally:
        use("dispatched")
        await engine.shutdown(1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="models/demo")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=1500, help="tokens of each fresh prompt timed to its first token")
    parser.add_argument("--out", default="ops/bench/results/layer_dispatch.json")
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    write_result(args.out, {**machine_info(args), **result})


if __name__ == "__main__":
    main()
