"""Attention keys and values held per row: no padding kept beyond what a row is charged for.

Each row of a batch keeps its own keys and values for every attention layer,
laid out one of two ways, chosen for every forward (``RowKV._arrange``):

- **rows**: each row's columns in a buffer of its own that grows ``STEP``
  columns at a time (a row prefilled in several chunks at once to its whole
  prompt and a round, ``reserved``: growing chunk by chunk would copy every
  column held at each chunk), so a row holds memory for its own tokens only, never for
  the longest row's. A row that joins or leaves touches only its own buffers.
  A row that starts from a cached prefix reads the prefix cache's columns in
  place (``shared``: the tree's immutable pieces, held alive by the row's
  lease) and writes only what follows into its own buffer, so many rows on one
  system prompt hold it once. Rows attend one by one
  (``attention.attend_rows``);
- **block**: every row's columns side by side in one array per side (rows,
  kv heads, capacity, D), written for all rows by one scatter and attended by
  one batched call under a mask (``attention.attend_block``): a few ops per
  layer, where rows cost a few per row. Taken when no row reads a prefix in
  place, no prefill padding is still to come, the shorter rows' padding to the
  longest fits what the KV budget has left beyond what it charges the rows (a
  round's growth each; ``room``, set before each round), and ``core.layout``
  measured it cheaper for these rows on this device.

Either way, rolling back a row's rejected tokens is a change of its length (a
draft tree's discarded branches: a gather within the row's newest columns). A
window's eviction, or a rollback reaching into the shared pieces, first copies
the row's columns into one buffer of its own (``_own``).

mlx-lm's attention modules write through ``cache.update_and_fetch`` and then
call ``scaled_dot_product_attention`` from ``mlx_lm.models.base`` with the
same cache. ``route_attention`` points a model's modules at ``row_attention``
here instead, which hands a ``RowKV`` layer's queries to ``RowKV.attend``.
Every other cache goes to mlx-lm's own function unchanged. A model whose
attention does not come through here, or that reads the keys it fetched for
anything else, is found at load (``attends`` stays 0, or its logits are
wrong) and runs row by row.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base

from . import attention, layout
from .columns import STEP, KVQuantization, Pieces, Side, like, pair_concat, parts, pieces_between, regrown, \
    side_columns, side_concat, side_slice, stored
from .layout import AttentionShape


class RowKV:
    """One attention layer's cache for a batch, one row per sequence.

    Per row b: its ``held[b]`` newest columns, the positions
    ``positions[b] - held[b]`` up to ``positions[b]``, are first the pieces
    ``shared[b]`` (read-only columns of the prefix cache, ``shared_columns[b]``
    in all), then the row's own columns: in ``keys[b]``/``values[b]`` (1, kv
    heads, capacity, D), or, in the block layout, in row b of ``block``
    (rows, kv heads, capacity, D) from column 0; ``pending[b]`` columns of
    left padding are still to come in the inputs of a prefill group, and are
    never stored.

    ``window`` (sliding-window attention, mlx-lm's ``RotatingKVCache``): a
    token sees the ``window`` most recent positions of its row, itself
    included; ``evict`` drops what no future token can see, only between
    rounds, so a rejected proposal never evicts what its replacement needs.
    While a draft tree is verified, ``tree`` (B, N, N) restricts the new
    tokens to their ancestors.
    """

    EVICT_SLACK = 16  # columns past twice the window before evicting
    _ROW_FIELDS = ("keys", "values", "shared", "shared_columns", "held", "positions", "pending", "shifts",
                   "reserved")

    def __init__(self, padding: list[int], window: int | None = None, quantization: KVQuantization | None = None):
        self.keys: list[Side | None] = [None] * len(padding)
        self.values: list[Side | None] = [None] * len(padding)
        self.block: tuple[Side, Side] | None = None  # every row's own columns, when laid out as one block
        self.quantization = quantization
        self.shared: list[Pieces] = [[] for _ in padding]
        self.shared_columns = [0] * len(padding)
        self.held = [0] * len(padding)
        self.positions = [0] * len(padding)
        self.pending = list(padding)
        self.shifts = [0] * len(padding)  # added to a row's RoPE offset (after a Qwen-VL prompt's images)
        self.reserved = [0] * len(padding)  # own columns a row's buffer grows to at once (``BatchRowCache.reserve``)
        self.window = window
        self.tree: mx.array | None = None
        self.attends = 0  # calls of ``attend``: 0 after a forward means the model's attention bypasses it
        self._written: list[tuple[int, int]] = []  # per row, the last update's (padding skipped, columns written)
        self._offset: mx.array | None = None
        self._shape: AttentionShape | None = None  # what the layouts' costs depend on, seen at the first ``attend``
        self.room = 0  # columns of padding beyond the rows' own that the KV budget has room for (a block's)

    @property
    def offset(self) -> mx.array:
        """(B,) RoPE offset of each row's next input column (its padding counted in, and its shift)."""
        if self._offset is None:
            self._offset = mx.array([p - q + s for p, q, s in zip(self.positions, self.pending, self.shifts)])
        return self._offset

    def shift(self, shifts: list[int]) -> None:
        """Rotate each row's later columns ``shifts[b]`` positions on from where they are stored:
        text after a Qwen-VL prompt's images sits at its index plus the images' rope delta."""
        self.shifts = list(shifts)
        self._offset = None

    def make_mask(self, *args, **kwargs) -> None:
        """``attend`` builds each row's mask itself."""
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store each row's new columns (its padding skipped); ``attend`` reads them back.
        Returns no columns: a model that reads what it fetched itself (layers that
        share another layer's keys, a sparse-attention indexer, a direct call of
        MLX's kernel) gets nothing to attend to, fails the load probe and runs row by row."""
        width, rows = keys.shape[2], len(self.held)
        new_keys, new_values = stored(keys, self.quantization), stored(values, self.quantization)
        self._arrange(width, new_keys, new_values)
        if self.block is not None:
            self._write_block(new_keys, new_values, width)
            self._written = [(0, width)] * rows
        else:
            self._written = []
            row_keys = _split_rows(new_keys, rows)
            row_values = _split_rows(new_values, rows)
            for b, (k, v) in enumerate(zip(row_keys, row_values)):
                skip = min(self.pending[b], width)
                self.pending[b] -= skip
                if skip < width:
                    self._append(b, side_slice(k, skip, width) if skip else k,
                                 side_slice(v, skip, width) if skip else v)
                self._written.append((skip, width - skip))
        self._offset = None
        return keys[..., :0, :], values[..., :0, :]

    # -- the layout -------------------------------------------------------------

    def _arrange(self, width: int, new_keys: Side, new_values: Side) -> None:
        """Lay the rows out for a forward of ``width`` columns: as a block or row by row."""
        block = self._block_pays(width)
        if self.block is not None and (not block or side_columns(self.block[0]) > _rounded(max(self.held) + width)):
            self._unblock()  # to rows, or to a narrower block: the longest rows left, the block may not keep their width
        if block and self.block is None:
            self.block = (_stacked(self.keys, self.held, new_keys, width), _stacked(self.values, self.held, new_values,
                                                                                      width))
            self.keys, self.values = [None] * len(self.held), [None] * len(self.held)

    def _block_pays(self, width: int) -> bool:
        """Whether this forward's rows take the block layout (see the module's docstring)."""
        if self.tree is not None:  # a draft tree's step keeps the layout: its rows attend one by one
            return self.block is not None
        if len(self.held) < 2 or any(self.pending) or any(self.shared_columns):
            return False
        held = [h + width for h in self.held]
        capacity = _rounded(max(held))
        if capacity * len(held) - sum(_rounded(h + STEP) for h in self.held) > self.room:  # padding past the budget
            return False
        if layout.LAYOUT != "auto":
            return layout.LAYOUT == "block"
        if self._shape is None:  # no forward attended yet: nothing to weigh
            return self.block is not None
        return layout.costs(self._shape, width).prefers_block(held, width, self.window, self.block is not None)

    def _unblock(self) -> None:
        """From the block layout to a buffer per row (copies of each row's columns)."""
        keys, values = self.block
        self.block = None
        for b, held in enumerate(self.held):
            if held:
                self.keys[b] = regrown(side_slice(_row(keys, b), 0, held), keys, held)
                self.values[b] = regrown(side_slice(_row(values, b), 0, held), values, held)

    def _write_block(self, keys: Side, values: Side, width: int) -> None:
        """Every row's new columns into the block, after the columns it holds (one scatter)."""
        block_keys, block_values = self.block
        need = max(self.held) + width
        if need > side_columns(block_keys):
            rows = len(self.held)
            block_keys = regrown(block_keys, block_keys, need, rows)
            block_values = regrown(block_values, block_values, need, rows)
        index = _write_index(tuple(self.held), width)
        self.block = (_scatter(block_keys, index, keys), _scatter(block_values, index, values))
        self.held = [h + width for h in self.held]
        self.positions = [p + width for p in self.positions]

    # -- rows ---------------------------------------------------------------------

    def _append(self, b: int, keys: Side, values: Side) -> None:
        own, n = self.held[b] - self.shared_columns[b], side_columns(keys)
        if self.keys[b] is None or own + n > side_columns(self.keys[b]):
            need = max(own + n, self.reserved[b])
            self.keys[b] = regrown(None if self.keys[b] is None else side_slice(self.keys[b], 0, own), keys, need)
            self.values[b] = regrown(None if self.values[b] is None else side_slice(self.values[b], 0, own),
                                     values, need)
        for buffer, new in ((self.keys[b], keys), (self.values[b], values)):
            for a, x in zip(parts(buffer), parts(new)):
                a[..., own:own + n, :] = x
        self.held[b] += n
        self.positions[b] += n

    def _pieces(self, b: int) -> Pieces:
        """Row b's held columns, in order: the shared pieces, then its own."""
        own = self.held[b] - self.shared_columns[b]
        if not own:
            return self.shared[b]
        if self.block is not None:
            keys, values = self.block
            return [(side_slice(_row(keys, b), 0, own), side_slice(_row(values, b), 0, own))]
        return self.shared[b] + [(side_slice(self.keys[b], 0, own), side_slice(self.values[b], 0, own))]

    def _row_columns(self, b: int, start: int, end: int) -> tuple[Side, Side]:
        """Row b's held columns [start, end), as a view where they lie in one piece."""
        return pair_concat(pieces_between(self._pieces(b), start, end))

    def _own(self, b: int, keep: int | None = None, in_place: int = 0) -> None:
        """Copy row b's newest ``keep`` (by default all) held columns into a buffer of its own, but
        for the first ``in_place`` of them, which it goes on reading in its shared pieces; older
        columns are dropped (a window's eviction, a rollback into shared pieces). Rows layout only."""
        held = self.held[b]
        keep = held if keep is None else keep
        if not self.shared[b] and keep == held:
            return
        first = held - keep
        keys, values = self._row_columns(b, first + in_place, held)
        self.shared[b] = pieces_between(self.shared[b], first, first + in_place)
        self.keys[b], self.values[b] = regrown(keys, keys, keep - in_place), regrown(values, values, keep - in_place)
        self.shared_columns[b], self.held[b] = in_place, keep

    # -- attention ----------------------------------------------------------------

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """The last update's queries (B, heads, N, D), each row over its own keys."""
        self.attends += 1
        if sinks is not None and self.quantization is not None:
            raise ValueError("quantized KV does not support attention sinks (gpt-oss): leave kvCache.bits unset")
        if self._shape is None:  # a row's own columns show the layer's shapes
            own = next((b for b, held in enumerate(self.held) if held - self.shared_columns[b]), None)
            if own is not None:
                self._shape = layout.attention_shape(self._pieces(own)[-1], queries, self.quantization,
                                                     sinks is not None)
        queries = queries * scale  # once for every row
        if self.block is not None and self.tree is None:
            keys, values = self.block
            return attention.attend_block(queries, keys, values, self.held, self.window, self.quantization, sinks)
        rows = [attention.RowColumns(skip, n, self._pieces(b), self.held[b],
                                     None if self.tree is None or not n
                                     else attention.tree_mask(self.tree[b], n, self.held[b], self.window))
                for b, (skip, n) in enumerate(self._written)]
        # one row attends as it is (gathering it would only copy its pieces together)
        if (len(rows) > 1 and self.tree is None and sinks is None and self.quantization is None
                and attention.gathers() and all(row.n and not row.skip for row in rows)):
            gathered = attention.attend_gathered(queries, rows, self.window)
            if gathered is not None:
                return gathered
        return attention.attend_rows(queries, rows, self.window, self.quantization, sinks)

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

    # -- rolling back, joining, leaving ---------------------------------------------

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
                if self.block is not None:
                    for a in parts(self.block[0]) + parts(self.block[1]):
                        a[b:b + 1, :, start:start + len(kept), :] = a[b:b + 1, :, index, :]
                else:
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
        if self.block is not None:
            self._unblock()
        keep = self.window - 1
        for b, held in enumerate(self.held):
            if held > keep:
                self._own(b, keep)

    def select(self, rows: list[int]) -> None:
        """Keep and reorder rows: nothing is copied but, in the block layout, the block."""
        if self.block is not None:
            index = mx.array(rows)
            self.block = tuple(like(side, [a[index] for a in parts(side)]) for side in self.block)
        for name in self._ROW_FIELDS:
            old = getattr(self, name)
            setattr(self, name, [old[i] for i in rows])
        self._offset = None

    def extend(self, other: "RowKV") -> None:
        """Append another cache's rows: nothing is copied but, in the block layout, the rows
        that join it (a row that reads a prefix in place, or a prefill's padding to come, sends
        the rows back to buffers of their own)."""
        if other.block is not None:
            other._unblock()
        if self.block is not None and (any(other.shared_columns) or any(other.pending)):
            self._unblock()
        if self.block is not None:
            keys, values = self.block
            capacity = max(side_columns(keys), _rounded(max(other.held, default=0)))
            if capacity > side_columns(keys):
                rows = len(self.held)
                keys, values = regrown(keys, keys, capacity, rows), regrown(values, values, capacity, rows)
            self.block = (side_concat([keys, _stacked(other.keys, other.held, keys, 0, capacity)], axis=0),
                          side_concat([values, _stacked(other.values, other.held, values, 0, capacity)], axis=0))
            other.keys, other.values = [None] * len(other.held), [None] * len(other.held)
        for name in self._ROW_FIELDS:
            getattr(self, name).extend(getattr(other, name))
        self._offset = None

    # -- the prefix cache ---------------------------------------------------------

    def columns(self, b: int, start: int, end: int) -> tuple[Side, Side] | None:
        """Row b's keys and values of positions [start, end); None if a
        sliding window already evicted some of them."""
        first = self.positions[b] - self.held[b]
        if start < first:
            return None
        return self._row_columns(b, start - first, end - first)

    def restore(self, b: int, pieces: Pieces, length: int, in_place: int | None = None) -> None:
        """Start the (fresh) row b from a cached prefix of ``length`` positions
        whose newest columns are ``pieces`` (the prefix cache's, never written):
        the row reads those of positions before ``in_place`` (by default all) in
        place, and copies the others into its own buffer."""
        if self.block is not None:
            self._unblock()
        held = sum(side_columns(k) for k, _ in pieces)
        self.shared[b], self.shared_columns[b] = list(pieces), held
        self.held[b], self.positions[b] = held, length
        self._offset = None
        if in_place is not None and in_place < length:
            self._own(b, in_place=max(0, in_place - (length - held)))

    @property
    def arrays(self) -> list[mx.array]:
        """The rows' own columns (the shared pieces are the prefix cache's)."""
        sides = list(self.block) if self.block is not None else self.keys + self.values
        return [a for side in sides if side is not None for a in parts(side)]

    @property
    def nbytes(self) -> int:
        """Bytes the rows' own columns take (their capacity, not only the columns held)."""
        return sum(a.nbytes for a in self.arrays)


def _rounded(columns: int) -> int:
    """Columns rounded up to a buffer's growth (``STEP``)."""
    return -(-columns // STEP) * STEP


def _row(side: Side, b: int) -> Side:
    """Row b of a block's side (a view)."""
    return like(side, [a[b:b + 1] for a in parts(side)])


def _split_rows(side: Side, rows: int) -> list[Side]:
    """A forward's new columns of every row, (B, ...), as one side per row (views)."""
    if rows == 1:
        return [side]
    return [like(side, list(group)) for group in zip(*(mx.split(a, rows) for a in parts(side)))]


def _stacked(buffers: list[Side | None], held: list[int], shape_of: Side, width: int,
             capacity: int | None = None) -> Side:
    """Rows' own columns as one block side (rows, kv heads, capacity, D), by default room for
    ``width`` more columns past the longest row (a row that holds nothing gets zeros)."""
    capacity = capacity or _rounded(max(held) + width)
    rows = []
    for buffer, columns in zip(buffers, held):
        if buffer is None:
            rows.append(regrown(None, shape_of, capacity))
        elif side_columns(buffer) >= capacity:
            rows.append(side_slice(buffer, 0, capacity))
        else:
            rows.append(regrown(side_slice(buffer, 0, columns), shape_of, capacity))
    return side_concat(rows, axis=0)


_WRITE_INDICES = attention.step_arrays()  # the last few steps' (every layer shares them)


def _write_index(held: tuple[int, ...], width: int) -> mx.array:
    """(B, 1, width, 1): the block columns each row's new columns go to."""
    index = attention.recalled(_WRITE_INDICES, (held, width))
    if index is None:
        columns = np.array(held, dtype=np.int32)[:, None] + np.arange(width, dtype=np.int32)[None, :]
        index = attention.remembered(_WRITE_INDICES, (held, width), mx.array(columns[:, None, :, None]),
                                     attention.MASKS_KEPT)
    return index


def _scatter(block: Side, index: mx.array, new: Side) -> Side:
    """``new`` (B, kv heads, width, D) written into ``block`` at each row's ``index`` columns."""
    return like(block, [mx.put_along_axis(a, mx.broadcast_to(index, x.shape), x, axis=2)
                        for a, x in zip(parts(block), parts(new))])


def row_attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float, mask,
                  sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, with ``RowKV`` layers attended by ``RowKV.attend``."""
    if isinstance(cache, RowKV):
        return cache.attend(queries, scale, sinks)
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                             sinks=sinks)


def route_attention(model: nn.Module) -> None:
    """Point every module of ``model`` that calls mlx-lm's attention function at ``row_attention``
    (the modules of its family; other caches than ``RowKV`` see no difference)."""
    for name in {type(module).__module__ for _, module in model.named_modules()}:
        namespace = sys.modules.get(name)
        if getattr(namespace, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            namespace.scaled_dot_product_attention = row_attention
