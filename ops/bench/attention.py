#!/usr/bin/env python3
"""Attention over a batch's per-row KV (``core/kv.py``, ``core/attention.py``), against mlx-lm's own caches.

In one run, on the model given (the demo target by default), it reports the
median time of, side by side:

* ``softmax``: attention's softmax over scores of a decode step, a verify
  forward and a prefill chunk: MLX's ``mx.softmax`` against specd's
  ``softmax`` (on the CPU backend, e**x from ``_exp2_parts``, one fused polynomial);
* ``forward``: a decode step of B rows and a prefill chunk over a long
  context, through specd's rows attended row by row on one stream (with each
  softmax), row by row with long rows dealt to one CPU stream per core
  (``attention.deal``: what a CPU of several cores runs), gathered into one
  call per layer (``attention.gathers``: what a GPU runs for rows read in
  pieces), laid out as one block (``layout.LAYOUT = "block"``), as the measured
  costs choose (``auto``, what specd runs), and through mlx-lm's
  ``BatchKVCache``/``KVCache`` (its attention, as ``mlx_lm.server`` runs it);
* ``long_prefill`` (``--long``, or ``--only-long``): a prefill chunk of 350 tokens
  (an agent's tool result) over 2,000 to 14,000 cached tokens, one row: specd
  (its queries in blocks within ``attention.BLOCK_SCORES``), specd in one block, and
  mlx-lm's ``KVCache``. The contexts are filled 2,048 tokens at a time.

    python ops/bench/attention.py [--model models/demo/target] [--runs 6] [--long | --only-long]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from spec_decode import machine_info, step_cost, write_result
from specd.core.loader import load_model as load  # as the daemon loads (core.cpu_jit first)
from specd.core import attention, layout
from specd.core.cache import make_row_cache


def median_ms(run: Callable[[], object], after: Callable[[], None] = lambda: None, repeat: int = 20) -> float:
    """Median milliseconds of ``run`` evaluated; ``after`` undoes it."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
        after()
    return 1000 * statistics.median(times)


def softmax_rows(shapes: dict[str, tuple[int, ...]]) -> list[dict]:
    out = []
    for name, shape in shapes.items():
        scores = mx.random.normal(shape)
        mx.eval(scores)
        mlx_ms = median_ms(lambda: mx.softmax(scores, axis=-1, precise=True), repeat=200)
        specd_ms = median_ms(lambda: attention.softmax(scores), repeat=200)
        out.append({"scores": name, "shape": list(shape), "mx_softmax_ms": mlx_ms, "specd_softmax_ms": specd_ms})
    return out


def mlx_lm_forward(model, rows: int, context: int, width: int) -> float:
    """Milliseconds of the forward ``step_cost`` times through specd's rows, through mlx-lm's
    caches instead (a batch's ``BatchKVCache``, one row's ``KVCache``)."""
    cache = [BatchKVCache([0] * rows) if rows > 1 else KVCache() for _ in model.layers]
    mx.eval(model(mx.zeros((rows, context), dtype=mx.int32) + 5, cache=cache))

    def undo() -> None:
        for c in cache:
            if isinstance(c, BatchKVCache):
                c.offset -= width
                c._idx -= width
            else:
                c.trim(width)
    inputs = mx.zeros((rows, width), dtype=mx.int32) + 7
    return median_ms(lambda: model(inputs, cache=cache), undo)


LONG_CONTEXTS = (2000, 6000, 14000)
LONG_WIDTH = 350


def _filled(model, cache: list, context: int) -> None:
    for first in range(0, context, 2048):
        mx.eval(model(mx.zeros((1, min(2048, context - first)), dtype=mx.int32) + 5, cache=cache))


def long_prefill_ms(model, context: int, specd: bool, reps: int = 3) -> float:
    """Milliseconds of one forward of ``LONG_WIDTH`` tokens over ``context`` cached ones, one row:
    through specd's rows (``specd``), else mlx-lm's ``KVCache``."""
    rows = make_row_cache(model, [0]) if specd else None
    cache = rows.layers if specd else [KVCache() for _ in model.layers]
    _filled(model, cache, context)
    inputs = mx.zeros((1, LONG_WIDTH), dtype=mx.int32) + 7

    def undo() -> None:
        if specd:
            rows.rollback([LONG_WIDTH])
        else:
            for c in cache:
                c.trim(LONG_WIDTH)
    return median_ms(lambda: model(inputs, cache=cache), undo, repeat=reps)


def long_prefill(model, runs: int) -> list[dict]:
    """specd (queries in blocks), specd in one block and mlx-lm, each first in turn, medians of runs."""
    own = attention.BLOCK_SCORES
    variants = {"specd": (True, own), "specd_one_block": (True, 1 << 62), "mlx_lm": (False, own)}
    out = []
    for context in LONG_CONTEXTS:
        times: dict[str, list[float]] = {v: [] for v in variants}
        for run in range(runs):
            order = list(variants)[run % 3:] + list(variants)[:run % 3]
            for variant in order:
                specd, attention.BLOCK_SCORES = variants[variant]
                times[variant].append(long_prefill_ms(model, context, specd))
            attention.BLOCK_SCORES = own
        out.append({"forward": f"prefill of {LONG_WIDTH} over {context:,}",
                    **{v: statistics.median(t) for v, t in times.items()}, "runs": times})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo/target")
    ap.add_argument("--runs", type=int, default=6, help="runs of every forward, each variant first in turn; medians")
    ap.add_argument("--out", default="ops/bench/results/attention.json")
    ap.add_argument("--long", action="store_true", help="also a prefill chunk over long contexts")
    ap.add_argument("--only-long", action="store_true", help="only that")
    args = ap.parse_args()

    mx.random.seed(0)
    model, _ = load(args.model)
    if args.only_long:
        report_long(args, long_prefill(model, args.runs))
        return
    kv_heads = model.args.num_key_value_heads
    group = model.args.num_attention_heads // kv_heads
    shapes = {"decode, 1,700 columns": (1, kv_heads, group, 1700),
              "verify of 4, 300 columns": (1, kv_heads, group * 4, 300),
              "prefill of 55, 1,655 columns": (1, kv_heads, group * 55, 1655)}
    softmax = softmax_rows(shapes)

    cases = [("decode, 4 rows x 1,700", 4, 1700, 1), ("decode, 8 rows x 300", 8, 300, 1),
             ("verify of 4, 8 rows x 300", 8, 300, 4), ("prefill of 55 over 1,600", 1, 1600, 55)]
    own_softmax, own_path, own_deal = attention.softmax, attention.gathers, attention.DEAL_MIN_SCORES
    one_stream = 1 << 62  # no row has this many scores: every row stays on the default stream

    def specd_ms(rows: int, context: int, width: int) -> float:
        return 1000 * step_cost(model, context, width, rows, reps=20)

    def mlx_lm_ms(rows: int, context: int, width: int) -> float:
        return mlx_lm_forward(model, rows, context, width)
    mx_softmax = lambda scores: mx.softmax(scores, axis=-1, precise=True)  # noqa: E731
    # (the softmax specd's attention uses, whether a layer's rows are gathered, the scores from which a
    # row is dealt to a stream of its own, the layout, the forward timed)
    variants = {"specd_row_by_row": (own_softmax, False, one_stream, "rows", specd_ms),
                "specd_dealt": (own_softmax, False, own_deal, "rows", specd_ms),
                "specd_gathered": (own_softmax, True, own_deal, "rows", specd_ms),
                "specd_block": (own_softmax, False, own_deal, "block", specd_ms),
                "specd_auto": (own_softmax, own_path(), own_deal, "auto", specd_ms),
                "specd_row_by_row_mx_softmax": (mx_softmax, False, one_stream, "rows", specd_ms),
                "mlx_lm": (own_softmax, False, own_deal, "rows", mlx_lm_ms)}
    runs: dict[str, dict[str, list[float]]] = {name: {v: [] for v in variants} for name, *_ in cases}
    for run in range(args.runs):
        first = run % len(variants)
        order = list(variants)[first:] + list(variants)[:first]  # each goes first in turn
        for name, rows, context, width in cases:
            for variant in order:
                attention.softmax, gathered, attention.DEAL_MIN_SCORES, layout.LAYOUT, forward = variants[variant]
                attention.gathers = lambda gathered=gathered: gathered
                runs[name][variant].append(forward(rows, context, width))
            attention.softmax, attention.gathers, attention.DEAL_MIN_SCORES = own_softmax, own_path, own_deal
            layout.LAYOUT = "auto"
    default = "specd_auto"
    forward = [{"forward": name, **{k: statistics.median(v) for k, v in by.items()}, "specd": statistics.median(by[default]),
                "runs": by} for name, by in runs.items()]

    print(f"{'softmax over':32} {'mx.softmax':>11} {'specd':>9} {'ratio':>7}")
    for r in softmax:
        print(f"{r['scores']:32} {r['mx_softmax_ms']:9.3f}ms {r['specd_softmax_ms']:7.3f}ms "
              f"{r['specd_softmax_ms'] / r['mx_softmax_ms']:6.2f}x")
    print(f"\n{'forward (medians of runs)':28} {'row by row':>11} {'dealt':>9} {'gathered':>9} {'block':>9} "
          f"{'auto':>9} {'rows, mx.softmax':>17} {'mlx_lm':>9} {'specd/mlx_lm':>13}   (specd: {default})")
    for r in forward:
        print(f"{r['forward']:28} {r['specd_row_by_row']:9.2f}ms {r['specd_dealt']:7.2f}ms {r['specd_gathered']:7.2f}ms "
              f"{r['specd_block']:7.2f}ms {r['specd_auto']:7.2f}ms {r['specd_row_by_row_mx_softmax']:15.2f}ms "
              f"{r['mlx_lm']:7.2f}ms {r['specd'] / r['mlx_lm']:12.2f}x")
    result = {"machine": machine_info(args), "device": str(mx.default_device()), "cpu_streams": attention.CPU_STREAMS,
              "specd_attention": default, "softmax": softmax, "forward": forward}
    if args.long:
        result["long_prefill"] = long_prefill(model, args.runs)
        print_long(result["long_prefill"])
    write_result(args.out, result)


def print_long(rows: list[dict]) -> None:
    print(f"\n{'long prefill (medians of runs)':32} {'specd':>9} {'one block':>10} {'mlx_lm':>9} {'specd/mlx_lm':>13}")
    for r in rows:
        print(f"{r['forward']:32} {r['specd']:7.1f}ms {r['specd_one_block']:8.1f}ms {r['mlx_lm']:7.1f}ms "
              f"{r['specd'] / r['mlx_lm']:12.2f}x")


def report_long(args: argparse.Namespace, rows: list[dict]) -> None:
    """``--only-long``: print it, and write it into the results file beside what is there."""
    print_long(rows)
    path = Path(args.out)
    result = json.loads(path.read_text()) if path.exists() else {}
    result["long_prefill"] = rows
    result["long_prefill_machine"] = machine_info(args)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
