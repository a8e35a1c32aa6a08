"""The compiled stand-ins for MLX's CPU fallbacks (``specd.core.cpu_fast``) against MLX's own, in turn.

On MLX's CPU backend, RMSNorm, LayerNorm and RoPE have no kernel: each call is a
fallback of ten to thirty small ops. ``specd.core.cpu_fast`` replaces them, on small
arrays (a small model's decode, verify and draft steps), with compiled functions that give
the same numbers. This
bench times both in one process, switching ``mx.fast`` between them run by run
(each run's ratio is to the run beside it: this machine's speed drifts by more than
the differences measured):

1. each op alone by the size of its array, MLX's own against the compiled version at
   every size (past the sizes where ``cpu_fast`` takes it: the limits it keeps);
2. single forwards of the target and the draft model through the engine's batched
   cache, at a decode step's and a verify forward's shapes;
3. the engine serving greedy code completions in process: spec-off at one and at
   eight clients, and the draft pairing's goodput default at eight, with its ratio to
   spec-off under each (the stand-ins save a plain step a larger share than a verify forward).

    python ops/bench/cpu_fast.py --pair models/demo --runs 8

Run with OpenBLAS preloaded (``source ops/env.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from typing import Any, Callable

import mlx.core as mx

from spec_decode import CODE_PROMPTS, machine_info, one_run, rewrite_prompts, write_result
from specd.core.loader import load_model as load  # as the daemon loads (core.cpu_jit first)
from specd.core import cpu_fast
from specd.core.cache import make_row_cache
from specd.core.request import Method, NO_SPECULATION, SpeculationConfig
from specd.engine.engine import Engine
from specd.engine.scheduler import EngineConfig
from specd.speculation.config import PolicySettings

SHAPES = ((1, 1), (8, 1), (8, 4))  # (rows, columns a row): decode steps and a verify forward of three proposals
ARMS = ("mlx", "stand-ins")


def use(arm: str) -> None:
    """``mx.fast`` as MLX ships it, or with specd's stand-ins."""
    for name, function in cpu_fast._ORIGINAL.items():
        setattr(mx.fast, name, function if arm == "mlx" else getattr(cpu_fast, name))


def forward_ms(model, rows: int, columns: int, reps: int = 30) -> float:
    """Median milliseconds of one forward over 96 cached columns a row."""
    cache = make_row_cache(model, [0] * rows)
    mx.eval(cache.forward(model, mx.zeros((rows, 96), dtype=mx.int32) + 5))
    inputs = mx.zeros((rows, columns), dtype=mx.int32) + 7
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(cache.forward(model, inputs, provisional=True))
        times.append(time.perf_counter() - start)
        cache.rollback([columns] * rows)
    return statistics.median(times) * 1e3


def paired(a: list[float], b: list[float]) -> float:
    return statistics.median([x / y for x, y in zip(a, b)])


def op_us(call, reps: int = 100) -> float:
    """Median microseconds of one call, timed as ten in one evaluation (a forward's calls are)."""
    times = []
    for _ in range(reps + 10):
        start = time.perf_counter()
        mx.eval([call() for _ in range(10)])
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1e5


def ops_by_size(runs: int) -> list[dict[str, Any]]:
    limits = cpu_fast.NORM_ELEMENTS, cpu_fast.ROPE_ELEMENTS
    cpu_fast.NORM_ELEMENTS = cpu_fast.ROPE_ELEMENTS = 1 << 30  # the compiled version at every size
    rows = []
    try:
        for hidden, batch in [(h, b) for h in (128, 256, 896) for b in (1, 4, 8, 16, 32)]:
            x, w = mx.random.normal((batch, 1, hidden)), mx.ones((hidden,))
            rows.append(("rms_norm", (batch, 1, hidden), lambda arm, x=x, w=w: (
                cpu_fast._ORIGINAL["rms_norm"] if arm == "mlx" else cpu_fast.rms_norm)(x, w, 1e-5)))
        for heads, batch, columns in [(h, b, c) for h in (2, 4, 14) for b, c in ((1, 1), (8, 1), (8, 4), (32, 1))]:
            x, offset = mx.random.normal((batch, heads, columns, 64)), mx.arange(batch) + 90
            rows.append(("rope", (batch, heads, columns, 64), lambda arm, x=x, offset=offset: (
                cpu_fast._ORIGINAL["rope"] if arm == "mlx" else cpu_fast.rope)(
                    x, 64, traditional=False, base=10000.0, scale=1.0, offset=offset)))
        out = []
        for op, shape, call in rows:
            timed: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for run in range(runs):
                for arm in (ARMS if run % 2 else ARMS[::-1]):
                    timed[arm].append(op_us(lambda: call(arm)))
            us = {arm: statistics.median(v) for arm, v in timed.items()}
            size = math.prod(shape)
            out.append({"op": op, "shape": shape, "elements": size, "mlx_us": us["mlx"],
                        "compiled_us": us["stand-ins"], "compiled_over_mlx": us["stand-ins"] / us["mlx"],
                        "compiled_by_cpu_fast": size <= (limits[0] if op == "rms_norm" else limits[1])})
            print(f"{op:8} {str(shape):18} {size:6} elements: MLX's own {us['mlx']:6.1f} us, compiled "
                  f"{us['stand-ins']:6.1f} us{'' if out[-1]['compiled_by_cpu_fast'] else '  (past the limit)'}")
    finally:
        cpu_fast.NORM_ELEMENTS, cpu_fast.ROPE_ELEMENTS = limits
    return out


def forwards(models: dict[str, Any], runs: int) -> list[dict[str, Any]]:
    rows = []
    for name, model in models.items():
        for batch, columns in SHAPES:
            ms: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for run in range(runs):
                for arm in (ARMS if run % 2 else ARMS[::-1]):
                    use(arm)
                    ms[arm].append(forward_ms(model, batch, columns))
            row = {"model": name, "rows": batch, "columns": columns,
                   **{f"{arm}_ms": statistics.median(v) for arm, v in ms.items()},
                   "stand_ins_over_mlx": paired(ms["stand-ins"], ms["mlx"])}
            print(f"{name:6} B{batch} x {columns}: MLX's own {row['mlx_ms']:.2f} ms, stand-ins "
                  f"{row['stand-ins_ms']:.2f} ms, time ratio {row['stand_ins_over_mlx']:.3f}")
            rows.append(row)
    return rows


def serving_configs(tokenizer) -> dict[str, tuple]:
    """Name: (prompts, speculation, policy, clients): greedy code completions served spec-off at one
    and at eight clients, and by the draft pairing's goodput default at eight."""
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS + rewrite_prompts()][:8]
    return {"spec-off c=1": (prompts[:3], NO_SPECULATION, None, 1),
            "spec-off c=8": (prompts, NO_SPECULATION, None, 8),
            "draft goodput c=8": (prompts, SpeculationConfig(Method.DRAFT, 3), PolicySettings(), 8)}


async def served_in_turn(engine: Engine, configs: dict[str, tuple], arms: tuple[str, str],
                         use_arm: Callable[[str], None], runs: int, max_tokens: int) -> dict[tuple[str, str], list[float]]:
    """Tokens/s of every configuration under each arm, ``runs`` turns of the arms in turn (ABBA..),
    every configuration in each; (configuration, arm) -> each run's."""
    tok_s: dict[tuple[str, str], list[float]] = {(c, a): [] for c in configs for a in arms}
    for run in range(runs + 1):  # the first turn warms both arms up (compiles, layouts, what goodput learns)
        for arm in (arms if run % 2 else arms[::-1]):
            use_arm(arm)
            for name, (batch, spec, policy, clients) in configs.items():
                engine.set_policy(policy, None if policy is None else "goodput-default")
                measured = await one_run(engine, batch, spec, max_tokens, clients)
                if run:
                    tok_s[(name, arm)].append(measured["tok_s"])
    engine.set_policy(None, None)
    return tok_s


async def serving(engine: Engine, tokenizer, runs: int, max_tokens: int) -> dict[str, Any]:
    configs = serving_configs(tokenizer)
    tok_s = await served_in_turn(engine, configs, ARMS, use, runs, max_tokens)
    result: dict[str, Any] = {}
    for name in configs:
        result[name] = {**{f"{arm}_tok_s": statistics.median(tok_s[(name, arm)]) for arm in ARMS},
                        "stand_ins_over_mlx": paired(tok_s[(name, "stand-ins")], tok_s[(name, "mlx")])}
        print(f"{name:18} MLX's own {result[name]['mlx_tok_s']:7.1f} tok/s, stand-ins "
              f"{result[name]['stand-ins_tok_s']:7.1f} tok/s, paired {result[name]['stand_ins_over_mlx']:.3f}")
    result["goodput_over_spec_off_c8"] = {
        arm: paired(tok_s[("draft goodput c=8", arm)], tok_s[("spec-off c=8", arm)]) for arm in ARMS}
    print("draft goodput / spec-off at c=8: " + ", ".join(
        f"{arm} {ratio:.3f}" for arm, ratio in result["goodput_over_spec_off_c8"].items()))
    return result


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    target, tokenizer = load(f"{args.pair}/target")
    draft, _ = load(f"{args.pair}/draft")
    engine = Engine("bench", target, tokenizer, EngineConfig(max_batch_size=16), drafter=draft)  # installs them
    engine.start()
    try:
        result = {"ops_by_size": ops_by_size(3), "forwards": forwards({"target": target, "draft": draft}, args.runs)}
        result["serving"] = await serving(engine, tokenizer, args.runs, args.max_tokens)
    finally:
        await engine.shutdown(1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="models/demo")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default="ops/bench/results/cpu_fast.json")
    args = parser.parse_args()
    if mx.default_device() != mx.cpu:
        raise SystemExit("the stand-ins replace only the CPU backend's fallbacks: run on the CPU")
    write_result(args.out, {"machine": machine_info(args), **asyncio.run(bench(args))})


if __name__ == "__main__":
    main()
