"""The per-row cache protocol, and its implementation over KV caches.

A continuous batch decodes sequences of different lengths together, and
speculation keeps a different number of proposed tokens in every row, so
every cache the speculator touches, the target's and every drafter's,
speaks one protocol (``RowCache``): the model's forward appends columns to
every row, then each row rolls back or forgets its own rejected columns, and
rows are selected and merged as sequences leave and join.

Rows of a KV cache are left-padded (mlx-lm's ``BatchKVCache`` convention):
the newest token of every sequence sits at the same column, the mask hides
each row's padding, and RoPE positions come from each row's own offset.
Per-row rollback is exact: a row's rejected tail is hidden from attention and
positions, and later squeezed out into left padding (``SpeculativeKVCache``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache


class RowCache(Protocol):
    """A model's batched cache, every layer, one row per sequence.

    ``layers`` is what the model's forward takes as ``cache=``; the forward
    appends the same number of columns to every row.  After it:

    - ``rollback(rejected)`` drops row b's last ``rejected[b]`` columns, so
      each row holds exactly its accepted tokens and no row is cut short
      because of another;
    - ``forget(drop)`` drops any of the last columns per row (a draft tree
      keeps one path of its nodes);
    - ``select(rows)`` keeps and reorders rows, ``merge(other)`` appends
      another cache's rows (a sequence leaves or joins between steps);
    - ``compact()`` squeezes out what rollback only hid, ``settle()``
      evaluates what rollback left lazy so the step that rolled back pays
      for it;
    - ``tree_attention(ancestry)`` restricts the next forward's new columns
      to their ancestors (draft trees).

    How each mlx-lm cache kind satisfies it:

    - KV (``SpeculativeKVCache``): rollback trims the columns every row drops
      and hides the rest as holes (masked, skipped by positions) until
      ``compact`` gathers them out.
    - Rotating window (sliding-window attention, ``keep`` sink tokens): the
      ring holds ``window + k_max`` slots, so writing a round's k + 1 columns
      never evicts a column that a rejected proposal's replacement still
      attends to; rollback moves each row's write position back and hides
      the rejected slots, the mask applies the window per row.
    - Recurrent state (SSM, gated delta net, short convs): there are no
      columns to hide, so rollback must return each row to the state after
      its last accepted token: the forward records the state after every
      verified position (or the state before it, and rollback re-advances
      the accepted tokens), and rollback picks row b's state at its accepted
      length; conv states are a tiny rotating window.  ``forget`` of inner
      columns and ``tree_attention`` have no meaning there: such models
      verify chains only.
    - ``CacheList``: each member follows its own kind.
    """

    layers: list

    @property
    def state(self) -> list:
        """Every array the cache holds (evaluated after a prefill chunk)."""

    def rollback(self, rejected: list[int]) -> None: ...

    def forget(self, drop: np.ndarray) -> None: ...

    def select(self, rows: list[int]) -> None: ...

    def merge(self, other: "RowCache") -> None: ...

    def compact(self) -> None: ...

    def settle(self) -> None: ...

    def tree_attention(self, ancestry: mx.array): ...


class SpeculativeKVCache(BatchKVCache):
    """``BatchKVCache`` with exact per-row rollback that copies nothing.

    Rolling every row's rejected tail into left padding rewrites the whole
    cache each step, a large part of a small model's step.  Instead the
    write index is rewound by the smallest rejection (free), and the rest of
    each row's rejected tail becomes a *hole*: still stored, never attended
    to (the mask hides it) and skipped by RoPE positions (``offset``).  When
    holes pile up they are squeezed out in one gather that turns them into
    left padding, which is the roll done once instead of every step.

    ``valid`` (B, _idx) marks the columns a row may attend to beyond its left
    padding; it is None while there are no holes.  ``holes`` counts each
    row's on the host, so deciding to compact costs no device sync.  While a
    draft tree is verified, ``tree`` restricts the new tokens to their
    ancestors, and ``forget`` keeps the accepted path's columns (the rest
    become holes).
    """

    COMPACT_FRACTION = 0.25

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.valid: mx.array | None = None
        self.holes: np.ndarray | None = None  # (B,) hidden columns per row, while ``valid`` is set
        self.tree: mx.array | None = None  # (B, N, N) ancestry of the N tokens being verified as a tree

    def update_and_fetch(self, keys, values):
        if self.valid is not None:
            self.valid = mx.concatenate(
                [self.valid, mx.ones((self.valid.shape[0], keys.shape[2]), dtype=mx.bool_)], axis=1)
        return super().update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if (not return_array and self.valid is None and self.tree is None and self.left_padding.shape[0] == 1
                and self.left_padding.item() == 0):
            return None if N == 1 else "causal"  # a lone unpadded row needs no mask array (a faster path)
        mask = super().make_mask(N, return_array=return_array or self.tree is not None, **kwargs)
        if self.valid is not None:
            seen = mx.concatenate([self.valid, mx.ones((self.valid.shape[0], N), dtype=mx.bool_)], axis=1)
            mask = mask & seen[:, None, None, :]
        if self.tree is not None:  # each new token sees the context and its own ancestors only
            mask = mx.concatenate([mask[..., :-N], mask[..., -N:] & self.tree[:, None]], axis=-1)
        return mask

    def trim(self, n):
        n = super().trim(n)
        if self.valid is not None:
            self.valid = self.valid[:, : self._idx]
        return n

    def hide(self, kept: mx.array, hidden: np.ndarray) -> None:
        """Make holes where ``kept`` (B, _idx) is False, ``hidden`` (B,) of them per row."""
        self.valid = kept if self.valid is None else self.valid & kept
        self.holes = hidden if self.holes is None else self.holes + hidden
        self.offset = self.offset - mx.array(hidden)

    def needs_compaction(self) -> bool:
        """Whether some row's holes fill more than COMPACT_FRACTION of the cache."""
        return self.holes is not None and self.holes.max() > self.COMPACT_FRACTION * self._idx

    def compact(self) -> None:
        """Squeeze the holes out: each row's live tokens move right, in order,
        and everything before them becomes left padding."""
        if self.valid is None:
            return
        n = self._idx
        cols = mx.arange(n)[None, :]
        live = self.valid & (cols >= self.left_padding[:, None])
        order = mx.argsort(live.astype(mx.int32) * n + cols, axis=1)  # dead columns first, then live in order
        index = order[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys[..., :n, :], index, axis=2)
        self.values = mx.take_along_axis(self.values[..., :n, :], index, axis=2)
        self.left_padding = n - live.sum(axis=1)
        self.valid = self.holes = None

    def filter(self, batch_indices):
        if self.valid is not None:
            self.compact()
        super().filter(batch_indices)

    def extend(self, other):
        self.compact()
        if isinstance(other, SpeculativeKVCache):
            other.compact()
        super().extend(other)


class KVRowCache:
    """``RowCache`` over one ``SpeculativeKVCache`` per layer."""

    def __init__(self, layers: list[SpeculativeKVCache]):
        self.layers = layers

    def rollback(self, rejected: list[int]) -> None:
        if any(rejected):
            width = max(rejected)
            self.forget(np.arange(width)[None, :] >= width - np.array(rejected)[:, None])

    def forget(self, drop: np.ndarray) -> None:
        """Forget, in each row b, the last ``width`` columns where ``drop[b]``
        (B, width) is set: the ones every row drops at the end are trimmed,
        the others become holes."""
        if not drop.any():
            return
        width = drop.shape[1]
        shared = 0
        while shared < width and drop[:, width - 1 - shared].all():
            shared += 1
        inner = drop[:, : width - shared]
        if inner.any():
            end = self.layers[0]._idx  # every layer holds the same columns
            hole = np.zeros((drop.shape[0], end), dtype=bool)
            hole[:, end - width: end - shared] = inner
            kept, hidden = mx.array(~hole), inner.sum(axis=1)
            for layer in self.layers:
                layer.hide(kept, hidden)
        for layer in self.layers:
            layer.trim(shared)
        if self.layers[0].needs_compaction():  # every layer has the same holes
            self.compact()

    def select(self, rows: list[int]) -> None:
        idx = mx.array(rows)
        for layer in self.layers:
            layer.filter(idx)

    def merge(self, other: "KVRowCache") -> None:
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend(theirs)

    def compact(self) -> None:
        for layer in self.layers:
            layer.compact()

    def settle(self) -> None:
        """Evaluate what rolling back left lazy (hole masks, offsets, a
        compaction's gather), so that the step that rolled back pays for it:
        the controller compares whole steps' times, and deferred work would
        be billed to the next step, which during a try from plain decoding is
        a plain one, making speculation look cheaper than it is."""
        mx.eval([array for layer in self.layers for array in (layer.keys, layer.values, layer.offset,
                                                               layer.left_padding, layer.valid)
                 if array is not None])

    @property
    def state(self) -> list:
        return [layer.state for layer in self.layers]

    @contextmanager
    def tree_attention(self, ancestry: mx.array) -> Iterator[None]:
        for layer in self.layers:
            layer.tree = ancestry
        try:
            yield
        finally:
            for layer in self.layers:
                layer.tree = None


def make_row_cache(model: nn.Module, left_padding: list[int]) -> KVRowCache:
    """One batched KV cache per layer; refuses models whose caches cannot batch."""
    layers = make_prompt_cache(model)
    kinds = {type(c) for c in layers}
    if kinds != {KVCache}:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise ValueError(f"continuous batching needs plain KV caches; this model uses {names}")
    return KVRowCache([SpeculativeKVCache(list(left_padding)) for _ in layers])
