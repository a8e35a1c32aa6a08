"""Attention keys and values held per row: no padding, no whole-batch copies.

Each row of a batch keeps its own keys and values for every attention layer,
in a buffer that grows ``STEP`` columns at a time, so a row holds memory for
its own tokens only, never for the longest row's.  A row that joins or
leaves the batch touches only its own buffers, and rolling back a row's
rejected tokens is a change of its length (a draft tree's discarded
branches: a gather within the row's newest columns).

A row that starts from a cached prefix reads the prefix cache's columns in
place (``shared``: the tree's immutable pieces, held alive by the row's
lease) and writes only what follows into its own buffer, so many rows on one
system prompt hold it once.  A window's eviction, or a rollback reaching
into the pieces, first copies the row's columns into one buffer (``_own``).

mlx-lm's attention modules write through ``cache.update_and_fetch`` and then
call ``scaled_dot_product_attention`` from ``mlx_lm.models.base`` with the
same cache.  ``route_attention`` points a model's modules at ``attention``
here instead, which hands a ``RowKV`` layer's queries to ``RowKV.attend``:
each row's queries over its own keys, exactly, row by row (no gather into
a padded batch, which would need the longest row's memory for every row
again, in every layer); on a CPU of several cores, long rows attend in
parallel, each dealt to one of a few CPU streams (``_deal``).  On a GPU, where
each of a row's kernels costs a launch, the rows' columns are put side by side
(nothing padded) and attended in one pass under a mask that keeps each query to
its own row (``gathers``).
Every other cache goes to mlx-lm's own function unchanged.  A model whose
attention does not come through here, or that reads the keys it fetched for
anything else, is found at load (``attends`` stays 0, or its logits are
wrong) and runs row by row.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base

STEP = 64  # columns a row's buffer grows by: a short row wastes little, a long one regrows rarely

# One side (keys or values) of some columns, (1, kv heads, n, D): an array, or the
# parts ``mx.quantize`` makes of it (packed weights, scales, biases) when the KV is quantized.
Side = Union[mx.array, tuple[mx.array, ...]]


@dataclass(frozen=True)
class KVQuantization:
    """Keys and values stored quantized, as mlx-lm's ``QuantizedKVCache`` stores them."""

    bits: int = 8
    group_size: int = 64


def parts(side: Side) -> tuple[mx.array, ...]:
    return side if isinstance(side, tuple) else (side,)


def _like(side: Side, arrays: list[mx.array]) -> Side:
    return tuple(arrays) if isinstance(side, tuple) else arrays[0]


def side_slice(side: Side, start: int, end: int) -> Side:
    """Columns [start, end)."""
    return _like(side, [a[..., start:end, :] for a in parts(side)])


def pair_slice(pair: tuple[Side, Side], start: int, end: int | None = None) -> tuple[Side, Side]:
    """Columns [start, end) (by default to the last) of a layer's keys and values."""
    keys, values = pair
    end = side_columns(keys) if end is None else end
    return side_slice(keys, start, end), side_slice(values, start, end)


def side_concat(sides: list[Side]) -> Side:
    """Columns of several pieces, in order (one piece as it is: no copy)."""
    if len(sides) == 1:
        return sides[0]
    return _like(sides[0], [mx.concatenate(group, axis=2) for group in zip(*map(parts, sides))])


def pair_concat(pairs: list[tuple[Side, Side]]) -> tuple[Side, Side]:
    """A layer's keys and values of several consecutive pieces, as one (one piece as it is: no copy)."""
    return side_concat([k for k, _ in pairs]), side_concat([v for _, v in pairs])


def side_columns(side: Side) -> int:
    return parts(side)[0].shape[2]


def side_bytes(side: Side) -> int:
    return sum(a.nbytes for a in parts(side))


def stored(side: mx.array, quantization: KVQuantization | None) -> Side:
    """Columns as a cache stores them: as they are, or what ``mx.quantize`` makes of them."""
    q = quantization
    return side if q is None else tuple(mx.quantize(side, group_size=q.group_size, bits=q.bits))


def _product(x: mx.array, side: Side, transpose: bool, quantization: KVQuantization | None) -> mx.array:
    """``x @ side`` (``side`` transposed if asked), dequantizing quantized columns as mlx-lm does."""
    if quantization is None:
        return x @ (side.swapaxes(-1, -2) if transpose else side)
    return mx.quantized_matmul(x, *side, transpose=transpose, group_size=quantization.group_size,
                               bits=quantization.bits)


def side_copy(side: Side) -> Side:
    """A copy that shares no buffer with ``side``."""
    return _like(side, [mx.contiguous(a) for a in parts(side)])


class RowKV:
    """One attention layer's cache for a batch, one buffer per row.

    Per row b: its ``held[b]`` newest columns, the positions
    ``positions[b] - held[b]`` up to ``positions[b]``, are first the pieces
    ``shared[b]`` (read-only columns of the prefix cache, ``shared_columns[b]``
    in all), then the row's own ``keys[b]``/``values[b]`` (1, kv heads,
    capacity, D); ``pending[b]`` columns of left padding are still to come in
    the inputs of a prefill group, and are never stored.

    ``window`` (sliding-window attention, mlx-lm's ``RotatingKVCache``): a
    token sees the ``window`` most recent positions of its row, itself
    included; ``evict`` drops what no future token can see, only between
    rounds, so a rejected proposal never evicts what its replacement needs.
    While a draft tree is verified, ``tree`` (B, N, N) restricts the new
    tokens to their ancestors.
    """

    EVICT_SLACK = 16  # columns past twice the window before evicting
    _ROW_FIELDS = ("keys", "values", "shared", "shared_columns", "held", "positions", "pending")

    def __init__(self, padding: list[int], window: int | None = None, quantization: KVQuantization | None = None):
        self.keys: list[Side | None] = [None] * len(padding)
        self.values: list[Side | None] = [None] * len(padding)
        self.quantization = quantization
        self.shared: list[list[tuple[Side, Side]]] = [[] for _ in padding]
        self.shared_columns = [0] * len(padding)
        self.held = [0] * len(padding)
        self.positions = [0] * len(padding)
        self.pending = list(padding)
        self.window = window
        self.tree: mx.array | None = None
        self.attends = 0  # calls of ``attend``: 0 after a forward means the model's attention bypasses it
        self._written: list[tuple[int, int]] = []  # per row, the last update's (padding skipped, columns written)
        self._offset: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        """(B,) RoPE offset of each row's next input column (its padding counted in)."""
        if self._offset is None:
            self._offset = mx.array([p - q for p, q in zip(self.positions, self.pending)])
        return self._offset

    def make_mask(self, *args, **kwargs) -> None:
        """``attend`` builds each row's mask itself."""
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store each row's new columns (its padding skipped); ``attend`` reads them back.
        Returns no columns: a model that reads what it fetched itself (layers that
        share another layer's keys, a sparse-attention indexer, a direct call of
        MLX's kernel) gets nothing to attend to, fails the load probe and runs row by row."""
        width, rows = keys.shape[2], len(self.held)
        self._written = []
        row_keys = mx.split(keys, rows) if rows > 1 else [keys]
        row_values = mx.split(values, rows) if rows > 1 else [values]
        for b, (k, v) in enumerate(zip(row_keys, row_values)):
            skip = min(self.pending[b], width)
            self.pending[b] -= skip
            if skip < width:
                if skip:
                    k, v = k[:, :, skip:, :], v[:, :, skip:, :]
                self._append(b, stored(k, self.quantization), stored(v, self.quantization))
            self._written.append((skip, width - skip))
        self._offset = None
        return keys[..., :0, :], values[..., :0, :]

    def _append(self, b: int, keys: Side, values: Side) -> None:
        own, n = self.held[b] - self.shared_columns[b], side_columns(keys)
        if self.keys[b] is None or own + n > side_columns(self.keys[b]):
            self.keys[b] = _regrown(None if self.keys[b] is None else side_slice(self.keys[b], 0, own), keys,
                                    own + n)
            self.values[b] = _regrown(None if self.values[b] is None else side_slice(self.values[b], 0, own),
                                      values, own + n)
        for buffer, new in ((self.keys[b], keys), (self.values[b], values)):
            for a, x in zip(parts(buffer), parts(new)):
                a[..., own:own + n, :] = x
        self.held[b] += n
        self.positions[b] += n

    def _pieces(self, b: int) -> list[tuple[Side, Side]]:
        """Row b's held columns, in order: the shared pieces, then its own."""
        own = self.held[b] - self.shared_columns[b]
        mine = [(side_slice(self.keys[b], 0, own), side_slice(self.values[b], 0, own))] if own else []
        return self.shared[b] + mine

    def _row_columns(self, b: int, start: int, end: int) -> tuple[Side, Side]:
        """Row b's held columns [start, end), as a view where they lie in one piece."""
        return pair_concat(_pieces_between(self._pieces(b), start, end))

    def _own(self, b: int, keep: int | None = None, in_place: int = 0) -> None:
        """Copy row b's newest ``keep`` (by default all) held columns into a buffer of its own, but
        for the first ``in_place`` of them, which it goes on reading in its shared pieces; older
        columns are dropped (a window's eviction, a rollback into shared pieces)."""
        held = self.held[b]
        keep = held if keep is None else keep
        if not self.shared[b] and keep == held:
            return
        first = held - keep
        keys, values = self._row_columns(b, first + in_place, held)
        self.shared[b] = _pieces_between(self.shared[b], first, first + in_place)
        self.keys[b], self.values[b] = _regrown(keys, keys, keep - in_place), _regrown(values, values, keep - in_place)
        self.shared_columns[b], self.held[b] = in_place, keep

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """The last update's queries (B, heads, N, D), each row over its own keys."""
        self.attends += 1
        if sinks is not None and self.quantization is not None:
            raise ValueError("quantized KV does not support attention sinks (gpt-oss): leave kvCache.bits unset")
        out: list[mx.array | None] = []
        queries = queries * scale  # once for every row
        # one row attends as it is (gathering it would only copy its pieces together)
        if (len(self._written) > 1 and self.tree is None and sinks is None and self.quantization is None
                and gathers() and all(n and not skip for skip, n in self._written)):
            gathered = self._attend_gathered(queries)
            if gathered is not None:
                return gathered
        row_queries = mx.split(queries, len(self._written)) if len(self._written) > 1 else [queries]
        streams = _deal([n * _seen_columns(self.held[b], n, self.window) for b, (_, n) in enumerate(self._written)])
        for b, ((skip, n), q, stream) in enumerate(zip(self._written, row_queries, streams)):
            if not n:  # a prompt that starts in a later chunk: its padding's output is never read
                out.append(None)
                continue
            q = q[:, :, skip:, :] if skip else q
            seen = None if self.tree is None else self._tree_mask(b, n, self.held[b])
            with mx.stream(stream):
                row = _attend_columns(q, self._pieces(b), self.held[b], self.window, self.quantization, sinks, seen)
            out.append(mx.pad(row, [(0, 0), (0, 0), (skip, 0), (0, 0)]) if skip else row)
        if len(out) == 1:
            return out[0]
        shape = next(row for row in out if row is not None).shape  # values may be narrower than queries
        return mx.concatenate([mx.zeros(shape, queries.dtype) if row is None else row for row in out])

    def _attend_gathered(self, queries: mx.array) -> mx.array | None:
        """Every row's new queries (B, heads, n, D), scaled, attended in one pass: the columns
        each row sees, of all rows side by side (one copy), and a mask that gives each query its
        own row's columns, causally and within the window. It computes scores for every row's
        columns, so it is taken only up to ``GATHER_MAX_SCORES`` (None above: row by row)."""
        rows, heads, n, dims = queries.shape
        seen = [_seen_columns(held, n, self.window) for held in self.held]
        starts = [held - columns for held, columns in zip(self.held, seen)]
        if rows * heads * n * sum(seen) > GATHER_MAX_SCORES:
            return None
        pieces = [p for b, start in enumerate(starts) for p in _pieces_between(self._pieces(b), start)]
        keys, values = pair_concat(pieces)
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        stacked = queries.reshape(rows, kv_heads, group, n, dims).transpose(1, 0, 2, 3, 4)
        scores = stacked.reshape(1, kv_heads, rows * group * n, dims) @ keys.swapaxes(-1, -2)
        # not MLX's fused attention: on CUDA it builds a cuDNN plan per column count, a new one every step
        scores = mx.where(_gather_mask(tuple(seen), n, group, self.window), scores, -mx.inf)
        out = _softmax(scores) @ values
        width = out.shape[-1]  # values may be narrower than queries
        return out.reshape(kv_heads, rows, group, n, width).transpose(1, 0, 2, 3, 4).reshape(rows, heads, n, width)

    def attend_with(self, queries: mx.array, scale: float, keys: mx.array, values: mx.array,
                    ancestry: mx.array) -> mx.array:
        """Queries (B, heads, n, D) of nodes not stored (a draft tree being
        grown) over each row's whole context and the nodes' own ``keys`` and
        ``values`` (B, kv heads, m, D) as ``ancestry`` (B, n, m) allows."""
        self.attends += 1
        out = []
        for b, held in enumerate(self.held):
            context = mx.ones((queries.shape[2], held), dtype=mx.bool_)
            row_keys, row_values = self._row_columns(b, 0, held)
            out.append(mx.fast.scaled_dot_product_attention(
                queries[b:b + 1], mx.concatenate([row_keys, keys[b:b + 1]], axis=2),
                mx.concatenate([row_values, values[b:b + 1]], axis=2),
                scale=scale, mask=mx.concatenate([context, ancestry[b]], axis=1)))
        return mx.concatenate(out)

    def _tree_mask(self, b: int, n: int, held: int) -> mx.array:
        """(n, held): what row b's ``n`` new tokens, nodes of a draft tree (the
        last of its ``held`` columns), may see: the context within the window
        in each node's own position, and their ancestors."""
        tree = self.tree[b]
        older = held - n
        if self.window is None:
            old = mx.ones((n, older), dtype=mx.bool_)
            new = tree
        else:
            depth = tree.sum(axis=-1) - 1  # a node's position is its depth past the context
            old = (depth[:, None] + older - mx.arange(older)[None, :]) < self.window
            new = tree & ((depth[:, None] - depth[None, :]) < self.window)
        return mx.concatenate([old, new], axis=1)

    def trim(self, n: int) -> None:
        """Drop every row's last ``n`` columns."""
        for b in range(len(self.held)):
            if self.held[b] - n < self.shared_columns[b]:
                self._own(b)
        self.held = [h - n for h in self.held]
        self.positions = [p - n for p in self.positions]
        self._offset = None

    def forget(self, drop: np.ndarray) -> None:
        """Forget, in each row b, the last ``drop.shape[1]`` columns where
        ``drop[b]`` is set; the kept ones close up in order."""
        width = drop.shape[1]
        for b in np.flatnonzero(drop.any(axis=1)):
            if self.held[b] - width < self.shared_columns[b]:
                self._own(b)
            kept = np.flatnonzero(~drop[b])
            start = self.held[b] - self.shared_columns[b] - width
            if len(kept) and kept[-1] >= len(kept):  # a kept column after a dropped one: close the gap
                index = mx.array(kept + start)
                for a in parts(self.keys[b]) + parts(self.values[b]):
                    a[..., start:start + len(kept), :] = a[..., index, :]
            gone = width - len(kept)
            self.held[b] -= gone
            self.positions[b] -= gone
        self._offset = None

    def needs_eviction(self) -> bool:
        """Whether some row of a window's cache holds so many columns that
        evicting pays (about one copy of its window per ``window`` steps)."""
        return self.window is not None and max(self.held, default=0) > 2 * self.window + self.EVICT_SLACK

    def evict(self) -> None:
        """Drop every column no future token can see: each row keeps its ``window - 1`` newest."""
        keep = self.window - 1
        for b, held in enumerate(self.held):
            if held > keep:
                self._own(b, keep)

    def select(self, rows: list[int]) -> None:
        """Keep and reorder rows: nothing is copied."""
        for name in self._ROW_FIELDS:
            old = getattr(self, name)
            setattr(self, name, [old[i] for i in rows])
        self._offset = None

    def extend(self, other: "RowKV") -> None:
        """Append another cache's rows: nothing is copied."""
        for name in self._ROW_FIELDS:
            getattr(self, name).extend(getattr(other, name))
        self._offset = None

    def columns(self, b: int, start: int, end: int) -> tuple[Side, Side] | None:
        """Row b's keys and values of positions [start, end); None if a
        sliding window already evicted some of them."""
        first = self.positions[b] - self.held[b]
        if start < first:
            return None
        return self._row_columns(b, start - first, end - first)

    def restore(self, b: int, pieces: list[tuple[Side, Side]], length: int, in_place: int | None = None) -> None:
        """Start the (fresh) row b from a cached prefix of ``length`` positions
        whose newest columns are ``pieces`` (the prefix cache's, never written):
        the row reads those of positions before ``in_place`` (by default all) in
        place, and copies the others into its own buffer."""
        held = sum(side_columns(k) for k, _ in pieces)
        self.shared[b], self.shared_columns[b] = list(pieces), held
        self.held[b], self.positions[b] = held, length
        self._offset = None
        if in_place is not None and in_place < length:
            self._own(b, in_place=max(0, in_place - (length - held)))

    @property
    def arrays(self) -> list[mx.array]:
        """The rows' own buffers (the shared pieces are the prefix cache's)."""
        return [a for side in self.keys + self.values if side is not None for a in parts(side)]

    @property
    def nbytes(self) -> int:
        """Bytes the rows' own buffers take (their capacity, not only the columns held)."""
        return sum(a.nbytes for a in self.arrays)


# Evaluated, shared by every layer and row of every engine thread, least recently used dropped past
# MASK_CACHE_CELLS (a prefill chunk's mask over a long context is megabytes)
_CAUSAL_MASKS: OrderedDict[tuple, mx.array] = OrderedDict()
_MASKS_LOCK = threading.Lock()
MASK_CACHE_CELLS = 1 << 26
_cached_cells = 0


def _cached_mask(masks: OrderedDict[tuple, mx.array], key: tuple) -> mx.array | None:
    """A mask already made, now the most recently used of ``masks`` (None if not made)."""
    with _MASKS_LOCK:
        mask = masks.get(key)
        if mask is not None:
            masks.move_to_end(key)
        return mask


def _causal_mask(n: int, held: int, capacity: int, window: int | None) -> mx.array:
    """(n, capacity): the last ``n`` of ``held`` columns see themselves and what is
    before them (within ``window``), and nothing past ``held``."""
    key = (n, held, capacity, window)
    mask = _cached_mask(_CAUSAL_MASKS, key)
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
        while _cached_cells > MASK_CACHE_CELLS and len(_CAUSAL_MASKS) > 1:
            _cached_cells -= _CAUSAL_MASKS.popitem(last=False)[1].size
    return mask


def _seen_columns(held: int, n: int, window: int | None) -> int:
    """Of a row's ``held`` columns, how many its ``n`` newest queries attend to (all, or the window's)."""
    return held if window is None else min(held, n + window - 1)


def _pieces_between(pieces: list[tuple[Side, Side]], start: int, end: int | None = None) -> list[tuple[Side, Side]]:
    """Columns [start, end) (by default to the last) of a row's consecutive pieces, in pieces
    (views, never copies)."""
    out, at = [], 0
    for k, v in pieces:
        n = side_columns(k)
        lo, hi = max(start - at, 0), n if end is None else min(end - at, n)
        at += n
        if hi > lo:
            out.append((k, v) if (lo, hi) == (0, n) else pair_slice((k, v), lo, hi))
    return out


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


def _deal(scores: list[int]) -> list[mx.Stream]:
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


def gathers() -> bool:
    """Whether a layer's rows attend in one pass (``RowKV._attend_gathered``) rather than row by
    row. On a GPU every row's few kernels cost a launch each, more than copying the batch's
    columns together (``ops/bench/results/gpu_h200.json``); on MLX's CPU backend, row by row is
    faster (``ops/bench/results/attention.json``)."""
    return mx.default_device() != mx.cpu


# Scores a gathered attention call may compute (each query scores every row's columns); above, the
# wasted work outgrows the launches it saves and rows attend one by one
GATHER_MAX_SCORES = 1 << 24
_GATHER_MASKS: OrderedDict[tuple, mx.array] = OrderedDict()  # the last few steps' (every layer shares them)
GATHER_MASKS_KEPT = 8


def _gather_mask(seen: tuple[int, ...], n: int, group: int, window: int | None) -> mx.array:
    """(rows * group * n, sum(seen)): query j of row b (of each of its ``group`` heads) sees the
    columns of row b's ``seen[b]`` that are at or before its own position, within ``window``."""
    key = (seen, n, group, window)
    mask = _cached_mask(_GATHER_MASKS, key)
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
    mask = mx.array(visible)
    with _MASKS_LOCK:
        _GATHER_MASKS[key] = mask
        while len(_GATHER_MASKS) > GATHER_MASKS_KEPT:
            _GATHER_MASKS.popitem(last=False)
    return mask


def _attend_columns(queries: mx.array, pieces: list[tuple[Side, Side]], held: int, window: int | None,
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
    blocks of queries whose scores stay within ``BLOCK_SCORES`` (``_in_blocks``)."""
    _, heads, n, dims = queries.shape
    columns = _seen_columns(held, n, window)
    if seen is None and n > 1 and heads * n * columns > BLOCK_SCORES and mx.default_device() == mx.cpu:
        return _in_blocks(queries, pieces, held, window, quantization, sinks)
    kv_heads = parts(pieces[0][0])[0].shape[1]
    start = held - columns
    seen_pieces = _pieces_between(pieces, start)
    grouped = queries.reshape(1, kv_heads, heads // kv_heads * n, dims)
    scores = [_product(grouped, k, True, quantization) for k, _ in seen_pieces]
    scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    if n > 1 or seen is not None:
        # every query's window begins at or after ``start``: no query sees a column before it
        seen = _causal_mask(n, columns, columns, window) if seen is None else seen[:, start:]
        scores = mx.where(seen, scores.reshape(1, kv_heads, heads // kv_heads, n, columns), -mx.inf)
        scores = scores.reshape(1, kv_heads, heads // kv_heads * n, columns)
    if sinks is None:
        weights = _softmax(scores)
    else:
        group = heads // kv_heads
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kv_heads, group, 1, 1),
                               (1, kv_heads, group, n, 1)).reshape(1, kv_heads, group * n, 1)
        weights = _softmax(mx.concatenate([sink, scores], axis=-1))[..., 1:]
    if len(seen_pieces) == 1:
        out = _product(weights, seen_pieces[0][1], False, quantization)
    else:
        bounds = list(itertools.accumulate(side_columns(v) for _, v in seen_pieces))[:-1]
        out = sum(_product(w, v, False, quantization)
                  for w, (_, v) in zip(mx.split(weights, bounds, axis=-1), seen_pieces))
    return out.reshape(1, heads, n, out.shape[-1])


# The most scores (heads x queries x columns) a row's queries attend over in one pass on the CPU. A
# prefill chunk over a long context is cut into blocks of queries within it: each block's scores,
# written and read by each op of the softmax in turn, then stay in the CPU's caches rather than go
# out to memory (``ops/bench/attention.py``: a prefill over 14,000 columns).
BLOCK_SCORES = 1 << 21


def _in_blocks(queries: mx.array, pieces: list[tuple[Side, Side]], held: int, window: int | None,
               quantization: KVQuantization | None, sinks: mx.array | None) -> mx.array:
    """``_attend_columns`` for queries (1, heads, n, D) in blocks of consecutive queries, each
    over the columns up to its last query's (a query sees no later column), within ``BLOCK_SCORES``."""
    _, heads, n, _ = queries.shape
    block = max(1, BLOCK_SCORES // (heads * _seen_columns(held, n, window)))
    out = []
    for first in range(0, n, block):
        last = min(n, first + block)
        end = held - (n - last)
        out.append(_attend_columns(queries[:, :, first:last], _pieces_between(pieces, 0, end), end, window,
                                   quantization, sinks))
    return mx.concatenate(out, axis=2)


LOG2E = 1.4426950408889634  # e**x == 2**(x * LOG2E)
ROUND = 12582912.0  # 1.5 * 2**23: adding it to a float32 below 2**22 in magnitude rounds it to an integer
# 2**f == e**(f ln 2): the Taylor terms up to f**7 (highest first), which for |f| <= 1/2 leave an error
# below float32's rounding
EXP2_TAYLOR = (1.525273380405984e-05, 1.5403530393381608e-04, 1.3333558146428443e-03, 9.618129107628477e-03,
               5.550410866482158e-02, 2.402265069591007e-01, 6.931471805599453e-01, 1.0)
# Below this, MLX's one fused softmax beats the few ops of ``_softmax`` (a decode or verify step's rows,
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


def _softmax(scores: mx.array) -> mx.array:
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


def _regrown(kept: Side | None, like: Side, need: int) -> Side:
    """A buffer for ``need`` columns shaped like ``like``, starting with the columns ``kept``."""
    capacity = -(-need // STEP) * STEP
    fresh = [mx.zeros((1, a.shape[1], capacity, a.shape[3]), dtype=a.dtype) for a in parts(like)]
    if kept is not None and side_columns(kept):
        for a, k in zip(fresh, parts(kept)):
            a[..., :k.shape[2], :] = k
    return _like(like, fresh)


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float, mask,
              sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, with ``RowKV`` layers attended row by row."""
    if isinstance(cache, RowKV):
        return cache.attend(queries, scale, sinks)
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                             sinks=sinks)


def route_attention(model: nn.Module) -> None:
    """Point every module of ``model`` that calls mlx-lm's attention function at ``attention``
    (the modules of its family; other caches than ``RowKV`` see no difference)."""
    for name in {type(module).__module__ for _, module in model.named_modules()}:
        namespace = sys.modules.get(name)
        if getattr(namespace, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            namespace.scaled_dot_product_attention = attention
