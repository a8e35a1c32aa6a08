#!/usr/bin/env python3
"""What exact rollback of recurrent state costs per speculation round.

A verify forward runs k + 1 tokens through a recurrent layer at once, and
mlx-lm's kernels return only the state after the last one.  When a row keeps
fewer tokens, its state must be the one after its last kept token.  Two ways:

* ``readvance`` (what specd does): keep the state from before the verify
  forward; on rollback restore it and run the model again over the kept
  tokens, in segments ending where some row's kept tokens end;
* ``checkpoint``: verify one token per forward, keeping the state after each
  (the only way to checkpoint every position without forking mlx-lm's
  kernels); rollback picks a row's state, free.

Both run on the same model and cache, for batch sizes and acceptance
patterns; the figure is milliseconds per round (verify plus rollback),
median over rounds, next to a verify forward that rolls nothing back.

Usage::

    python ops/bench/recurrent_rollback.py --model models/families/recurrent-<recipe>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from specd.core.cache import make_row_cache
from spec_decode import write_result
from specd.core.loader import load_model

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "recurrent_rollback.json"


def round_ms(model, batch: int, k: int, rejected: list[int], how: str, rounds: int, context: int) -> float:
    """Median milliseconds of one verify-and-rollback round."""
    rng = np.random.default_rng(0)
    cache = make_row_cache(model, [0] * batch)
    mx.eval(cache.forward(model, mx.array(rng.integers(1, 1000, (batch, context)))))
    times = []
    for _ in range(rounds):
        tokens = mx.array(rng.integers(1, 1000, (batch, k + 1)))
        started = time.perf_counter()
        if how == "checkpoint":
            states, logits = [], []
            for j in range(k + 1):
                logits.append(cache.forward(model, tokens[:, j: j + 1]))
                states.append([list(leaf.cache) for leaf in cache.recurrent])
            mx.eval(logits, states)
            keep = [k + 1 - r for r in rejected]
            for i, leaf in enumerate(cache.recurrent):  # each row's state after its last kept token
                leaf.cache = [mx.stack([states[n - 1][i][s][b] for b, n in enumerate(keep)])
                              for s in range(len(leaf.cache))]
            drop = np.arange(k + 1)[None, :] >= np.array(keep)[:, None]
            for group in cache.attention:  # the attention layers drop the rejected columns as usual
                for leaf in group:
                    leaf.forget(drop)
        else:
            mx.eval(cache.forward(model, tokens, provisional=how == "readvance"))
            cache.rollback(rejected if how == "readvance" else [0] * batch)
        cache.settle()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    model, _ = load_model(str(args.model))
    k = args.k
    results = []
    print(f"{'batch':>5} {'acceptance':<26} {'verify only':>12} {'readvance':>10} {'checkpoint':>11}  (ms/round)")
    for batch in args.batch:
        patterns = {"one row rejects 2": [2] + [0] * (batch - 1),
                    "every row rejects some": [(b % k) + 1 for b in range(batch)]}
        for name, rejected in patterns.items():
            row = {"batch": batch, "k": k, "rejected": rejected, "pattern": name}
            for how in ("verify", "readvance", "checkpoint"):
                row[f"{how}_ms"] = round_ms(model, batch, k, rejected, how, args.rounds, args.context)
            results.append(row)
            print(f"{batch:>5} {name:<26} {row['verify_ms']:>12.2f} {row['readvance_ms']:>10.2f} "
                  f"{row['checkpoint_ms']:>11.2f}")
    write_result(args.out, {"benchmark": "recurrent_rollback", "model": str(args.model),
                            "created_unix": time.time(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
