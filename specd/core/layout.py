"""Whether a batch's attention layers hold their rows' columns as one block, by measured cost.

Row by row (``attention.attend_rows``) costs a few ops per row and layer, plus
each row's own columns; one block (``attention.attend_block``) costs a few ops
per layer, plus every row padded to the longest. Which is cheaper depends on
the device (a GPU pays a launch per op; a CPU of several cores attends long
rows in parallel), the model's attention shapes and the batch. So the first
time a shape is met, both are timed on this device over synthetic rows of a
few batch sizes and lengths (``measure``), and each cost is fitted as a line:
rows ``a * B + b * columns``, a block ``c + d * B * longest`` (the longest
row's columns). Each forward width a step meets (a decode step's one query a
row, a verify forward's 1 + k) is timed at that width, up to
``MEASURED_WIDTHS``: several queries a row do not cost the width times one
query's (row by row masks each row's queries, the block all of them at once),
so one width's lines would mislead another's choice. A wider forward (a
prefill chunk of rows alike) scales the widest measured. A step then takes the
cheaper, keeping its current layout unless the other saves ``MARGIN`` (a
change of layout copies the rows' columns once).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .attention import RowColumns, attend_block, attend_rows, seen_columns
from .columns import KVQuantization, Side, parts, stored

# "auto": by measured cost; "rows" or "block": always that layout where it may be taken (tests and
# benchmarks compare them)
LAYOUT = "auto"
MARGIN = 0.9  # a step changes layout only if the other costs less than this share of the current one
PROBES = ((2, 64), (16, 64), (2, 512), (16, 512))  # (rows, columns) the costs are timed at
REPEATS = 4  # attention calls timed together, as a step's layers run them
SAMPLES = 5  # timings per probe, the median kept
# Forward widths (queries a row) timed as they are: a decode step's one and a verify forward of up to
# three proposals. A wider forward (longer proposals, a drafter catching up, a prefill chunk of rows
# alike) scales the widest's costs: each width timed is a tenth of a second or more of the step that
# first meets it, and the widths past it are met rarely, some once
MEASURED_WIDTHS = 4


@dataclass(frozen=True)
class AttentionShape:
    """What a layer's attention costs depend on, besides the batch."""

    kv_heads: int
    heads: int
    dims: int
    value_dims: int
    dtype: mx.Dtype
    quantization: KVQuantization | None
    sinks: bool


def attention_shape(sample: tuple[Side, Side], queries: mx.array, quantization: KVQuantization | None,
                    sinks: bool) -> AttentionShape:
    """A layer's shape from one row's piece of keys and values and its queries (B, heads, N, D)."""
    keys, values = (parts(side)[0] for side in sample)
    value_dims = values.shape[-1] if quantization is None else values.shape[-1] * 32 // quantization.bits
    return AttentionShape(keys.shape[1], queries.shape[1], queries.shape[-1], value_dims, queries.dtype,
                          quantization, sinks)


@dataclass(frozen=True)
class LayoutCosts:
    """Seconds of one attention call over a batch, timed with ``width`` queries a row: row by
    row ``per_row * B + per_column * columns``, as a block ``fixed + per_cell * B * columns``;
    a forward of n queries a row scales the column terms by ``n / width``."""

    per_row: float
    per_column: float
    fixed: float
    per_cell: float
    width: int = 1

    def rows(self, held: list[int], n: int, window: int | None) -> float:
        columns = sum(seen_columns(h, n, window) for h in held)
        return self.per_row * len(held) + self.per_column * n / self.width * columns

    def block(self, held: list[int], n: int) -> float:
        return self.fixed + self.per_cell * n / self.width * len(held) * max(held)

    def prefers_block(self, held: list[int], n: int, window: int | None, now_block: bool) -> bool:
        """Whether rows holding ``held`` columns after a forward of ``n`` attend as a block."""
        rows, block = self.rows(held, n, window), self.block(held, n)
        return block < rows if now_block else block < MARGIN * rows


_MEASURED: dict[tuple[AttentionShape, int], LayoutCosts] = {}
_LOCK = threading.Lock()
_TIMING = threading.local()  # per engine thread: the seconds ``costs`` spent timing layouts


def clock() -> float:
    """``time.perf_counter()`` less the seconds this thread has spent timing layouts: two readings
    differ by what a step itself cost. The step that first meets an attention shape or width
    times both layouts inside it, once; the cost model and the goodput controller learn what
    each k costs from steps' seconds, and that one-off (tenths of a second) would price its width
    far above a step's cost, a width then never chosen again to correct it."""
    return time.perf_counter() - getattr(_TIMING, "seconds", 0.0)


def costs(shape: AttentionShape, width: int = 1) -> LayoutCosts:
    """The costs of ``shape`` on this device for a forward of ``width`` queries a row, timed the
    first time that width (or ``MEASURED_WIDTHS``, for a wider one) is asked for."""
    key = (shape, min(width, MEASURED_WIDTHS))
    with _LOCK:
        known = _MEASURED.get(key)
    if known is None:
        started = time.perf_counter()
        known = measure(*key)
        _TIMING.seconds = getattr(_TIMING, "seconds", 0.0) + time.perf_counter() - started
        with _LOCK:
            _MEASURED.setdefault(key, known)
    return known


def measure(shape: AttentionShape, width: int = 1) -> LayoutCosts:
    """Time both layouts over synthetic rows of ``width`` queries at each of ``PROBES`` and fit
    their lines."""
    rows_seconds, block_seconds = [], []
    for count, columns in PROBES:
        queries = mx.random.normal((count, shape.heads, width, shape.dims)).astype(shape.dtype)
        keys = stored(mx.random.normal((count, shape.kv_heads, columns, shape.dims)).astype(shape.dtype),
                      shape.quantization)
        values = stored(mx.random.normal((count, shape.kv_heads, columns, shape.value_dims)).astype(shape.dtype),
                        shape.quantization)
        sinks = mx.zeros((shape.heads,)) if shape.sinks else None
        row_keys = [_row(keys, b) for b in range(count)]
        row_values = [_row(values, b) for b in range(count)]
        mx.eval(queries, keys, values, row_keys, row_values)
        held = [columns] * count
        rows = [RowColumns(0, width, [(k, v)], columns) for k, v in zip(row_keys, row_values)]
        rows_seconds.append(_timed(lambda: attend_rows(queries, rows, None, shape.quantization, sinks)))
        block_seconds.append(_timed(lambda: attend_block(queries, keys, values, held, None, shape.quantization,
                                                         sinks)))
    per_row, per_column = _fit([(count, count * columns) for count, columns in PROBES], rows_seconds)
    fixed, per_cell = _fit([(1, count * columns) for count, columns in PROBES], block_seconds)
    return LayoutCosts(per_row, per_column, fixed, per_cell, width)


def _row(side, b: int):
    if isinstance(side, tuple):
        return tuple(mx.contiguous(a[b:b + 1]) for a in side)
    return mx.contiguous(side[b:b + 1])


def _timed(attend) -> float:
    """Median seconds of ``REPEATS`` calls evaluated together (after one untimed run)."""
    mx.eval([attend() for _ in range(REPEATS)])
    samples = []
    for _ in range(SAMPLES):
        started = time.perf_counter()
        mx.eval([attend() for _ in range(REPEATS)])
        samples.append((time.perf_counter() - started) / REPEATS)
    return statistics.median(samples)


def _fit(features: list[tuple[float, float]], seconds: list[float]) -> tuple[float, float]:
    """Non-negative least squares of ``seconds`` on two features (a cost never falls with more work)."""
    x, y = np.array(features, dtype=np.float64), np.array(seconds, dtype=np.float64)
    solution = np.linalg.lstsq(x, y, rcond=None)[0]
    if solution.min() >= 0:
        return float(solution[0]), float(solution[1])
    # one coefficient would be negative: the best fit with it at zero
    alone = [float(max(0.0, (x[:, i] @ y) / (x[:, i] @ x[:, i]))) for i in range(2)]
    errors = [np.sum((y - x[:, i] * alone[i]) ** 2) for i in range(2)]
    return (alone[0], 0.0) if errors[0] <= errors[1] else (0.0, alone[1])
