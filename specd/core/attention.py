"""Attention over a batch's KV columns, exactly, in the ways a step can lay them out.

- **Row by row** (``attend_rows``): each row's queries over that row's own
  columns, read in place from its pieces (a cached prefix's, then its own
  buffer), the mask only where a row has more than one new token. No row pays
  for another's length, and a row may read a cached prefix in place. It costs a
  few ops per row and layer; on a CPU of several cores, long rows attend in
  parallel, dealt to a few CPU streams (``deal``).
- **As one block** (``attend_block``): every row's own columns side by side in
  one padded array (``RowKV``'s block layout), attended by one batched call
  under a mask that keeps each query to its own row's columns (causally, within
  the window). A few ops per layer whatever the batch, but every row pays for
  the block's width. ``core.layout`` chooses between the two by their measured
  cost.
- **Gathered** (``attend_gathered``): on a GPU, rows whose columns lie in
  pieces (a prefix read in place) are put side by side (nothing padded) and
  attended in one pass under a mask, for the launches a row's kernels cost.

Row by row is the reference the others are tested against, token for token.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np

from .columns import KVQuantization, Pieces, Side, pair_concat, parts, pieces_between, product, side_columns, \
    side_slice

_MASKS_LOCK = threading.Lock()
_STEP_ARRAYS: list[OrderedDict[tuple, mx.array]] = []  # every memo ``step_arrays`` made


def step_arrays() -> OrderedDict[tuple, mx.array]:
    """A new memo of small arrays that a step's layers share (masks, the columns each row's new keys
    go to), which ``forget_masks`` empties with the others when an engine drains."""
    memo: OrderedDict[tuple, mx.array] = OrderedDict()
    _STEP_ARRAYS.append(memo)
    return memo


# Evaluated, shared by every layer and row of every engine thread, least recently used dropped past
# MASK_CACHE_CELLS (a prefill chunk's mask over a long context is megabytes) or MASK_CACHE_ENTRIES
# (a step's rows each ask for their own, and rows' lengths move on every step: a daemon that served
# for hours would otherwise keep a mask of every length it met, up to the cells' bound)
_CAUSAL_MASKS = step_arrays()
MASK_CACHE_CELLS = 1 << 26
MASK_CACHE_ENTRIES = 512
_cached_cells = 0


def recalled(masks: OrderedDict[tuple, mx.array], key: tuple) -> mx.array | None:
    """An array already made, now the most recently used of ``masks`` (None if not made)."""
    with _MASKS_LOCK:
        mask = masks.get(key)
        if mask is not None:
            masks.move_to_end(key)
        return mask


def remembered(masks: OrderedDict[tuple, mx.array], key: tuple, mask: mx.array, kept: int) -> mx.array:
    """``mask``, remembered among the ``kept`` most recent of ``masks`` (a step's layers share it)."""
    with _MASKS_LOCK:
        masks[key] = mask
        while len(masks) > kept:
            masks.popitem(last=False)
    return mask


def forget_masks() -> None:
    """Drop every mask and shared array remembered (``step_arrays``): what a drained engine's steps
    asked for would otherwise stay for the engines after it, up to ``MASK_CACHE_CELLS`` of them with
    no engine loaded at all (a step remakes what it asks for again)."""
    global _cached_cells
    with _MASKS_LOCK:
        for memo in _STEP_ARRAYS:
            memo.clear()
        _cached_cells = 0


def causal_mask(n: int, held: int, capacity: int, window: int | None) -> mx.array:
    """(n, capacity): the last ``n`` of ``held`` columns see themselves and what is
    before them (within ``window``), and nothing past ``held``."""
    key = (n, held, capacity, window)
    mask = recalled(_CAUSAL_MASKS, key)
    if mask is not None:
        return mask
    columns = mx.arange(capacity)[None, :]
    rows = mx.arange(held - n, held)[:, None]
    mask = (columns <= rows) if window is None else (columns <= rows) & (columns > rows - window)
    mx.eval(mask)
    global _cached_cells
    with _MASKS_LOCK:
        if key not in _CAUSAL_MASKS:
            _CAUSAL_MASKS[key] = mask
            _cached_cells += mask.size
        while (_cached_cells > MASK_CACHE_CELLS or len(_CAUSAL_MASKS) > MASK_CACHE_ENTRIES) and len(_CAUSAL_MASKS) > 1:
            _cached_cells -= _CAUSAL_MASKS.popitem(last=False)[1].size
    return mask


def seen_columns(held: int, n: int, window: int | None) -> int:
    """Of a row's ``held`` columns, how many its ``n`` newest queries attend to (all, or the window's)."""
    return held if window is None else min(held, n + window - 1)


def tree_mask(tree: mx.array, n: int, held: int, window: int | None) -> mx.array:
    """(n, held): what a row's ``n`` new tokens, nodes of a draft tree (``tree``, (n, n):
    each node's ancestors and itself; the last of the row's ``held`` columns), may see: the
    context within the window in each node's own position, and their ancestors."""
    older = held - n
    if window is None:
        return mx.concatenate([mx.ones((n, older), dtype=mx.bool_), tree], axis=1)
    depth = tree.sum(axis=-1) - 1  # a node's position is its depth past the context
    old = (depth[:, None] + older - mx.arange(older)[None, :]) < window
    return mx.concatenate([old, tree & ((depth[:, None] - depth[None, :]) < window)], axis=1)


@dataclass
class RowColumns:
    """What one row's queries of a forward attend over."""

    skip: int  # columns of left padding this forward wrote for the row (queries past them are its own)
    n: int  # the row's new columns (its queries)
    pieces: Pieces  # the row's held columns, in order
    held: int
    seen: mx.array | None = None  # (n, held): which columns each query sees (a draft tree's nodes)


def _cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Streams a layer's rows are dealt to on the CPU, the default one among them: one per core, at most
# 4, as MLX keeps a thread for each stream an engine thread makes until the process ends (engine
# threads are reused, ``engine/threads.py``, and their streams with them).
CPU_STREAMS = min(_cores(), 4)
# A row attends on a stream of its own only with at least this many scores (queries x columns): each
# stream it is handed to costs a synchronisation, which a short row's attention does not pay for.
DEAL_MIN_SCORES = 512
_streams = threading.local()  # MLX's streams belong to the thread that made them


def deal(scores: list[int]) -> list[mx.Stream]:
    """The stream each row of a layer attends on. MLX's CPU backend runs one stream's ops in
    order on one thread, so a layer's rows, which do not depend on each other, attend in parallel
    on ``CPU_STREAMS`` streams: the longest rows first, each to the stream with the least work so
    far (rows below ``DEAL_MIN_SCORES`` stay on the default stream). On a GPU, or with one core,
    every row stays on the default stream."""
    default = mx.default_stream(mx.default_device())
    if (mx.default_device() != mx.cpu or CPU_STREAMS < 2
            or sum(1 for s in scores if s >= DEAL_MIN_SCORES) < 2):
        return [default] * len(scores)
    streams = [default, *_further_cpu_streams(CPU_STREAMS - 1)]
    load = [sum(s for s in scores if s < DEAL_MIN_SCORES)] + [0] * (len(streams) - 1)
    dealt = [default] * len(scores)
    for b in sorted(range(len(scores)), key=lambda b: -scores[b]):
        if scores[b] >= DEAL_MIN_SCORES:
            least = min(range(len(streams)), key=load.__getitem__)
            load[least] += scores[b]
            dealt[b] = streams[least]
    return dealt


def _further_cpu_streams(n: int) -> list[mx.Stream]:
    """``n`` CPU streams of this thread's own besides its default one."""
    further = _streams.__dict__.setdefault("cpu", [])
    further.extend(mx.new_stream(mx.cpu) for _ in range(n - len(further)))
    return further[:n]


def attend_rows(queries: mx.array, rows: list[RowColumns], window: int | None,
                quantization: KVQuantization | None = None, sinks: mx.array | None = None) -> mx.array:
    """Queries (B, heads, N, D), scaled, each row's over its own columns; a row's padding
    (``skip``, or a row that wrote nothing) gets zeros, which nothing reads."""
    out: list[mx.array | None] = []
    row_queries = mx.split(queries, len(rows)) if len(rows) > 1 else [queries]
    streams = deal([row.n * seen_columns(row.held, row.n, window) for row in rows])
    for row, q, stream in zip(rows, row_queries, streams):
        if not row.n:  # a prompt that starts in a later chunk: its padding's output is never read
            out.append(None)
            continue
        q = q[:, :, row.skip:, :] if row.skip else q
        with mx.stream(stream):
            attended = attend_columns(q, row.pieces, row.held, window, quantization, sinks, row.seen)
        out.append(mx.pad(attended, [(0, 0), (0, 0), (row.skip, 0), (0, 0)]) if row.skip else attended)
    if len(out) == 1:
        return out[0]
    shape = next(row for row in out if row is not None).shape  # values may be narrower than queries
    return mx.concatenate([mx.zeros(shape, queries.dtype) if row is None else row for row in out])


def gathers() -> bool:
    """Whether a layer's rows whose columns lie in pieces attend in one pass (``attend_gathered``)
    rather than row by row. On a GPU every row's few kernels cost a launch each, more than copying
    the batch's columns together (``ops/bench/results/gpu_h200.json``); on MLX's CPU backend, row
    by row is faster (``ops/bench/results/attention.json``)."""
    return mx.default_device() != mx.cpu


# Scores a gathered attention call may compute (each query scores every row's columns); above, the
# wasted work outgrows the launches it saves and rows attend one by one
GATHER_MAX_SCORES = 1 << 24
_GATHER_MASKS = step_arrays()  # the last few steps' (every layer shares them)
MASKS_KEPT = 8


def _gather_mask(seen: tuple[int, ...], n: int, group: int, window: int | None) -> mx.array:
    """(rows * group * n, sum(seen)): query j of row b (of each of its ``group`` heads) sees the
    columns of row b's ``seen[b]`` that are at or before its own position, within ``window``."""
    key = (seen, n, group, window)
    mask = recalled(_GATHER_MASKS, key)
    if mask is not None:
        return mask
    lengths = np.array(seen)
    column_row = np.repeat(np.arange(len(seen)), lengths)
    column = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    query_row = np.repeat(np.arange(len(seen)), group * n)
    position = np.repeat(lengths - n, group * n) + np.tile(np.arange(n), len(seen) * group)
    visible = (column_row[None, :] == query_row[:, None]) & (column[None, :] <= position[:, None])
    if window is not None:
        visible &= column[None, :] > position[:, None] - window
    return remembered(_GATHER_MASKS, key, mx.array(visible), MASKS_KEPT)


def attend_gathered(queries: mx.array, rows: list[RowColumns], window: int | None) -> mx.array | None:
    """Every row's new queries (B, heads, n, D), scaled, attended in one pass: the columns
    each row sees, of all rows side by side (one copy), and a mask that gives each query its
    own row's columns, causally and within the window. It computes scores for every row's
    columns, so it is taken only up to ``GATHER_MAX_SCORES`` (None above: row by row)."""
    count, heads, n, dims = queries.shape
    seen = [seen_columns(row.held, n, window) for row in rows]
    if count * heads * n * sum(seen) > GATHER_MAX_SCORES:
        return None
    pieces = [p for row, columns in zip(rows, seen) for p in pieces_between(row.pieces, row.held - columns)]
    keys, values = pair_concat(pieces)
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    stacked = queries.reshape(count, kv_heads, group, n, dims).transpose(1, 0, 2, 3, 4)
    scores = stacked.reshape(1, kv_heads, count * group * n, dims) @ keys.swapaxes(-1, -2)
    # not MLX's fused attention: on CUDA it builds a cuDNN plan per column count, a new one every step
    scores = mx.where(_gather_mask(tuple(seen), n, group, window), scores, -mx.inf)
    out = softmax(scores) @ values
    width = out.shape[-1]  # values may be narrower than queries
    return out.reshape(kv_heads, count, group, n, width).transpose(1, 0, 2, 3, 4).reshape(count, heads, n, width)


_BLOCK_MASKS = step_arrays()  # the last few steps' (every layer shares them)


def _block_mask(held: tuple[int, ...], n: int, group: int, window: int | None, columns: int) -> mx.array:
    """(B, 1, group * n, columns): of row b's ``held[b]`` columns (laid out from column 0), query j
    (of each of its ``group`` heads) sees those at or before its position ``held[b] - n + j``,
    within ``window``."""
    key = (held, n, group, window, columns)
    mask = recalled(_BLOCK_MASKS, key)
    if mask is not None:
        return mask
    position = np.array(held)[:, None] - n + np.arange(n)[None, :]  # (B, n)
    column = np.arange(columns)[None, None, :]
    visible = column <= position[:, :, None]
    if window is not None:
        visible &= column > position[:, :, None] - window
    visible = np.broadcast_to(visible[:, None, None], (len(held), 1, group, n, columns))
    return remembered(_BLOCK_MASKS, key, mx.array(visible.reshape(len(held), 1, group * n, columns)), MASKS_KEPT)


def attend_block(queries: mx.array, keys: Side, values: Side, held: list[int], window: int | None,
                 quantization: KVQuantization | None = None, sinks: mx.array | None = None) -> mx.array:
    """Queries (B, heads, n, D), scaled, of rows whose columns lie side by side in one block
    (B, kv heads, capacity, D) from column 0, row b holding ``held[b]`` (its ``n`` newest being
    the queries' own): one batched call over the block's first ``max(held)`` columns, under a
    mask that gives each query its own row's columns, causally and within ``window``. A query's
    group of heads shares its key-value head through a reshape; quantized columns are read as
    mlx-lm reads them; ``sinks`` (heads,) are one more logit per head."""
    count, heads, n, dims = queries.shape
    columns = max(held)
    keys, values = side_slice(keys, 0, columns), side_slice(values, 0, columns)
    kv_heads = parts(keys)[0].shape[1]
    group = heads // kv_heads
    scores = product(queries.reshape(count, kv_heads, group * n, dims), keys, True, quantization)
    scores = mx.where(_block_mask(tuple(held), n, group, window, columns), scores, -mx.inf)
    if sinks is None:
        weights = softmax(scores)
    else:
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kv_heads, group, 1, 1),
                               (count, kv_heads, group, n, 1)).reshape(count, kv_heads, group * n, 1)
        weights = softmax(mx.concatenate([sink, scores], axis=-1))[..., 1:]
    out = product(weights, values, False, quantization)
    return out.reshape(count, heads, n, out.shape[-1])


def attend_columns(queries: mx.array, pieces: Pieces, held: int, window: int | None,
                   quantization: KVQuantization | None = None, sinks: mx.array | None = None,
                   seen: mx.array | None = None) -> mx.array:
    """A row's ``n`` newest queries (1, heads, n, D), scaled, over the columns of its ``held`` that they
    see (causally, within ``window``, or as ``seen`` (n, held) says: a draft tree's nodes), read in
    place from the row's ``pieces`` (keys, values) in order: a query's group of heads shares its
    key-value head through a reshape rather than a broadcast copy, a single query needs no mask,
    and several pieces are one softmax over their scores side by side (only the scores are
    concatenated, never the keys or values). Quantized pieces are read as mlx-lm's
    ``quantized_scaled_dot_product_attention`` reads them; ``sinks`` (heads,) are one more logit
    per head in the softmax, with no value (gpt-oss). Many queries over many columns attend in
    blocks of queries whose scores stay within ``block_scores()`` (``_in_blocks``)."""
    _, heads, n, dims = queries.shape
    columns = seen_columns(held, n, window)
    if seen is None and n > 1 and heads * n * columns > block_scores():
        return _in_blocks(queries, pieces, held, window, quantization, sinks)
    kv_heads = parts(pieces[0][0])[0].shape[1]
    start = held - columns
    seen_pieces = pieces_between(pieces, start)
    grouped = queries.reshape(1, kv_heads, heads // kv_heads * n, dims)
    scores = [product(grouped, k, True, quantization) for k, _ in seen_pieces]
    scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    if n > 1 or seen is not None:
        # every query's window begins at or after ``start``: no query sees a column before it
        seen = causal_mask(n, columns, columns, window) if seen is None else seen[:, start:]
        scores = mx.where(seen, scores.reshape(1, kv_heads, heads // kv_heads, n, columns), -mx.inf)
        scores = scores.reshape(1, kv_heads, heads // kv_heads * n, columns)
    if sinks is None:
        weights = softmax(scores)
    else:
        group = heads // kv_heads
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kv_heads, group, 1, 1),
                               (1, kv_heads, group, n, 1)).reshape(1, kv_heads, group * n, 1)
        weights = softmax(mx.concatenate([sink, scores], axis=-1))[..., 1:]
    if len(seen_pieces) == 1:
        out = product(weights, seen_pieces[0][1], False, quantization)
    else:
        bounds = list(itertools.accumulate(side_columns(v) for _, v in seen_pieces))[:-1]
        out = sum(product(w, v, False, quantization)
                  for w, (_, v) in zip(mx.split(weights, bounds, axis=-1), seen_pieces))
    return out.reshape(1, heads, n, out.shape[-1])


# The most scores (heads x queries x columns) a row's queries attend over in one pass on the CPU. A
# prefill chunk over a long context is cut into blocks of queries within it: each block's scores,
# written and read by each op of the softmax in turn, then stay in the CPU's caches rather than go
# out to memory (``ops/bench/attention.py``: a prefill over 14,000 columns). The blocks run one
# after another, so what a chunk holds of them is bounded however long the context
# (``engine.resources.ENGINE_OVERHEAD`` counts it).
BLOCK_SCORES = 1 << 21
# On a GPU the blocks bound memory only: a chunk's scores over a long context in one pass would be
# gigabytes (2,048 queries x 16,000 columns x 32 heads: 4 GB in float32), where the overhead a
# Model's request counts is 256 MiB. A block of 2^24 scores is 64 MB in float32, a few of which its
# softmax holds at once, and still one large kernel per op (as many as a gathered call may compute,
# ``GATHER_MAX_SCORES``).
GPU_BLOCK_SCORES = 1 << 24


def block_scores() -> int:
    """The most scores a row's queries attend over in one pass on the default device."""
    return BLOCK_SCORES if mx.default_device() == mx.cpu else GPU_BLOCK_SCORES


def _in_blocks(queries: mx.array, pieces: Pieces, held: int, window: int | None,
               quantization: KVQuantization | None, sinks: mx.array | None) -> mx.array:
    """``attend_columns`` for queries (1, heads, n, D) in blocks of consecutive queries, each
    over the columns up to its last query's (a query sees no later column), within ``block_scores()``."""
    _, heads, n, _ = queries.shape
    block = max(1, block_scores() // (heads * seen_columns(held, n, window)))
    out = []
    for first in range(0, n, block):
        last = min(n, first + block)
        end = held - (n - last)
        block_queries = queries[:, :, first:last]
        if out:  # after the block before: one block's scores at a time, not every block's at once
            block_queries = mx.depends(block_queries, out[-1])
        out.append(attend_columns(block_queries, pieces_between(pieces, 0, end), end, window, quantization, sinks))
    return mx.concatenate(out, axis=2)


LOG2E = 1.4426950408889634  # e**x == 2**(x * LOG2E)
ROUND = 12582912.0  # 1.5 * 2**23: adding it to a float32 below 2**22 in magnitude rounds it to an integer
# 2**f == e**(f ln 2): the Taylor terms up to f**7 (highest first), which for |f| <= 1/2 leave an error
# below float32's rounding
EXP2_TAYLOR = (1.525273380405984e-05, 1.5403530393381608e-04, 1.3333558146428443e-03, 9.618129107628477e-03,
               5.550410866482158e-02, 2.402265069591007e-01, 6.931471805599453e-01, 1.0)
# Below this, MLX's one fused softmax beats the few ops of ``softmax`` (a decode or verify step's rows,
# more so when they are dealt to several streams); a prefill chunk's scores are far above it
SOFTMAX_MIN_SCORES = 1 << 14


@partial(mx.compile, shapeless=True)
def _exp2_parts(x: mx.array, peak: mx.array) -> tuple[mx.array, mx.array]:
    """e**(x - peak) for ``x <= peak``, as 2**f (a polynomial) and the bits of the float 2**n, where
    n + f == (x - peak) log2 e, n an integer and |f| <= 1/2 (floored at 2**-126: nothing a softmax
    weighs). Elementwise arithmetic only, so MLX's CPU backend fuses it into one pass (where a C++
    compiler is at hand; unfused otherwise); the bits become a float outside, as compiled functions
    cannot reinterpret an array."""
    y = mx.maximum((x - peak) * LOG2E, -126.0)
    n = (y + ROUND) - ROUND
    f = y - n
    power = EXP2_TAYLOR[0]
    for term in EXP2_TAYLOR[1:]:
        power = power * f + term
    return power, mx.left_shift(n.astype(mx.int32) + 127, 23)


def softmax(scores: mx.array) -> mx.array:
    """Attention's softmax over the last axis, in float32 (``precise``, as mlx-lm's attention).
    On MLX's CPU backend ``mx.exp`` costs many times its arithmetic ops, and a prefill chunk's
    softmax most of its attention (``ops/bench/attention.py``): there, scores past ``SOFTMAX_MIN_SCORES``
    take e**x from ``_exp2_parts``, within a few float32 roundings of MLX's own softmax. Elsewhere,
    and for fewer scores, MLX's own softmax."""
    if mx.default_device() != mx.cpu or scores.size < SOFTMAX_MIN_SCORES:
        return mx.softmax(scores, axis=-1, precise=True)
    x = scores.astype(mx.float32)
    power, exponent = _exp2_parts(x, x.max(axis=-1, keepdims=True))
    e = power * exponent.view(mx.float32)
    total = e @ mx.ones((e.shape[-1], 1), dtype=mx.float32)  # a product: that backend's sum is several times slower
    return (e / total).astype(scores.dtype)
