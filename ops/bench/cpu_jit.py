"""MLX's CPU kernels built with the CPU's FMA (``specd.core.cpu_jit``) against as MLX builds them, in turn.

MLX keeps the kernels it built for the life of a process, so each arm runs in processes of its
own, the two arms' processes taken in turn (ABAB..; each ratio is to the process beside it: this
machine's speed drifts by more than the differences measured). A process measures:

1. mlx-lm's compiled SwiGLU alone, at the demo target's decode and verify shapes;
2. single forwards of the target and the draft model through the engine's batched cache
   (``cpu_fast.forward_ms``), at a decode step's and a verify forward's shapes;
3. the engine serving greedy code completions in process: spec-off at one and at eight
   clients, and the draft pairing's goodput default at eight.

The "as built" arm keeps ``cpu_jit.install`` from running, so it builds (or takes from
``$TMPDIR/mlx``) kernels as MLX builds them, as ``mlx_lm.server`` does.

    python ops/bench/cpu_jit.py --pair models/demo --processes 4

Run with OpenBLAS preloaded (``source ops/env.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ARMS = ("as built", "fma")
SWIGLU_SHAPES = ((1, 1, 704), (8, 1, 704), (8, 4, 704), (32, 1, 704))


def swiglu_us() -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models.activations import swiglu

    from cpu_fast import op_us

    out = {}
    for shape in SWIGLU_SHAPES:
        gate, up = mx.random.normal(shape), mx.random.normal(shape)
        out["x".join(map(str, shape))] = op_us(lambda: swiglu(gate, up))
    return out


async def one_process(args: argparse.Namespace) -> dict[str, Any]:
    """What one process of one arm measures (run as ``--arm``)."""
    from specd.core import cpu_jit

    if args.arm == "as built":
        cpu_jit.install = lambda: False  # the loader's and the runner's calls find it gone
    from cpu_fast import SHAPES, forward_ms, paired, served_in_turn, serving_configs
    from specd.core.loader import load_model
    from specd.engine.engine import Engine
    from specd.engine.scheduler import EngineConfig

    target, tokenizer = load_model(f"{args.pair}/target")
    draft, _ = load_model(f"{args.pair}/draft")
    engine = Engine("bench", target, tokenizer, EngineConfig(max_batch_size=16), drafter=draft)
    engine.start()
    try:
        result: dict[str, Any] = {"swiglu_us": swiglu_us()}
        result["forward_ms"] = {f"{name} B{rows} x {columns}": statistics.median(
            forward_ms(model, rows, columns) for _ in range(3))
            for name, model in (("target", target), ("draft", draft)) for rows, columns in SHAPES}
        configs = serving_configs(tokenizer)
        # this process's one arm: what each configuration served, run after run (the first warms up)
        served = await served_in_turn(engine, configs, (args.arm,), lambda arm: None, args.runs, args.max_tokens)
        tok_s = {name: served[(name, args.arm)] for name in configs}
        result["tok_s"] = {name: statistics.median(v) for name, v in tok_s.items()}
        result["tok_s"]["goodput / spec-off c=8"] = paired(tok_s["draft goodput c=8"], tok_s["spec-off c=8"])
    finally:
        await engine.shutdown(1)
    return result


def in_turn(args: argparse.Namespace) -> dict[str, Any]:
    """``--processes`` processes of each arm, taken in turn; paired ratios fma / as built."""
    per_arm: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for turn in range(args.processes):
        for arm in (ARMS if turn % 2 == 0 else ARMS[::-1]):
            done = subprocess.run([sys.executable, __file__, "--arm", arm, "--pair", args.pair, "--runs",
                                   str(args.runs), "--max-tokens", str(args.max_tokens)],
                                  capture_output=True, text=True, check=True)
            per_arm[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"turn {turn} {arm}: {per_arm[arm][-1]['tok_s']}", flush=True)
    from cpu_fast import paired

    rows = {}
    for section in ("swiglu_us", "forward_ms", "tok_s"):
        for key in per_arm["fma"][0][section]:
            values = {arm: [p[section][key] for p in per_arm[arm]] for arm in ARMS}
            rows[f"{section} {key}"] = {**{arm: statistics.median(v) for arm, v in values.items()},
                                        "fma_over_as_built": paired(values["fma"], values["as built"])}
    for name, row in rows.items():
        print(f"{name:42} as built {row['as built']:9.2f}  fma {row['fma']:9.2f}  paired {row['fma_over_as_built']:.3f}")
    return {"processes": per_arm, "summary": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="models/demo")
    parser.add_argument("--processes", type=int, default=4, help="processes of each arm")
    parser.add_argument("--runs", type=int, default=3, help="serving runs a process")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="ops/bench/results/cpu_jit.json")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.arm:
        print(json.dumps(asyncio.run(one_process(args))))
        return
    from spec_decode import machine_info, write_result

    from specd.core import cpu_jit
    if not cpu_jit.applies():
        raise SystemExit("core.cpu_jit applies to x86-64 Linux CPUs with FMA and a g++ only")
    write_result(args.out, {"machine": machine_info(args), "method": "python " + " ".join(sys.argv),
                            **in_turn(args)})


if __name__ == "__main__":
    main()
