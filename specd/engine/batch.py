"""The running batch: sequences and their per-layer batched KV cache, kept in step.

Rows of the cache are left-padded (mlx-lm's ``BatchKVCache`` convention): the
newest token of every sequence sits at the same column, the mask hides each
row's padding, and RoPE positions come from each row's own offset.  That is
what lets sequences of different lengths decode together, join between steps
(``extend``) and leave (``filter``).  Per-sequence rollback after speculation
is exact: a row's rejected tail is hidden from attention and positions, and
later squeezed out into left padding (``SpeculativeKVCache``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .sequence import Sequence


class SpeculativeKVCache(BatchKVCache):
    """``BatchKVCache`` with exact per-row rollback that copies nothing.

    Rolling every row's rejected tail into left padding rewrites the whole
    cache each step (measured: 20-45% of a small model's step).  Instead the
    write index is rewound by the smallest rejection (free), and the rest of
    each row's rejected tail becomes a *hole*: still stored, never attended
    to (the mask hides it) and skipped by RoPE positions (``offset``).  When
    holes pile up they are squeezed out in one gather that turns them into
    left padding, which is the roll done once instead of every step.

    ``valid`` (B, _idx) marks the columns a row may attend to beyond its left
    padding; it is None while there are no holes.  ``holes`` counts each
    row's on the host, so deciding to compact costs no device sync (one cost
    5% of a decode step at a batch of 8).  While a draft tree is
    verified, ``tree`` restricts the new tokens to their ancestors, and
    ``forget`` keeps the accepted path's columns (the rest become holes).
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


def make_batch_cache(model: nn.Module, left_padding: list[int]) -> list[SpeculativeKVCache]:
    """One batched KV cache per layer; refuses models whose caches cannot batch."""
    layers = make_prompt_cache(model)
    kinds = {type(c) for c in layers}
    if kinds != {KVCache}:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise ValueError(f"continuous batching needs plain KV caches; this model uses {names}")
    return [SpeculativeKVCache(list(left_padding)) for _ in layers]


def rollback(cache: list[SpeculativeKVCache], rejected: list[int]) -> None:
    """Drop the last ``rejected[b]`` cached tokens of row b, in every layer, so
    each row holds exactly its accepted tokens and no row is cut short because
    of another."""
    if any(rejected):
        width = max(rejected)
        forget(cache, np.arange(width)[None, :] >= width - np.array(rejected)[:, None])


def forget(cache: list[SpeculativeKVCache], drop: np.ndarray) -> None:
    """Forget, in every layer and each row b, the last ``width`` columns where
    ``drop[b]`` (B, width) is set: the ones every row drops at the end are
    trimmed, the others become holes (a draft tree keeps one path of its nodes)."""
    if not drop.any():
        return
    width = drop.shape[1]
    shared = 0
    while shared < width and drop[:, width - 1 - shared].all():
        shared += 1
    inner = drop[:, : width - shared]
    if inner.any():
        end = cache[0]._idx  # every layer holds the same columns
        hole = np.zeros((drop.shape[0], end), dtype=bool)
        hole[:, end - width: end - shared] = inner
        kept, hidden = mx.array(~hole), inner.sum(axis=1)
        for layer in cache:
            layer.hide(kept, hidden)
    for layer in cache:
        layer.trim(shared)
    if cache[0].needs_compaction():  # every layer has the same holes
        for layer in cache:
            layer.compact()


def settle(cache: list[SpeculativeKVCache]) -> None:
    """Evaluate what rolling back left lazy (hole masks, offsets, a
    compaction's gather), so that the step that rolled back pays for it:
    the controller compares whole steps' times, and deferred work would be
    billed to the next step, which during a try from plain decoding is a
    plain one, making speculation look cheaper than it is."""
    mx.eval([array for layer in cache for array in (layer.keys, layer.values, layer.offset, layer.left_padding,
                                                     layer.valid) if array is not None])


class RunningBatch:
    """Sequences that decode together, row b of the cache belonging to seqs[b]."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.cache: list[BatchKVCache] = []
        self.last_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.seqs)

    def extend(self, seqs: list[Sequence], cache: list[BatchKVCache], last_tokens: list[int]) -> None:
        """Add freshly prefilled sequences (their cache rows come along)."""
        if not self.seqs:
            self.seqs, self.cache, self.last_tokens = list(seqs), cache, list(last_tokens)
            return
        for mine, theirs in zip(self.cache, cache):
            mine.extend(theirs)
        self.seqs.extend(seqs)
        self.last_tokens.extend(last_tokens)

    def keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished or cancelled sequences leave)."""
        if len(keep) == len(self.seqs):
            return
        if not keep:
            self.seqs, self.cache, self.last_tokens = [], [], []
            return
        idx = mx.array(keep)
        for layer in self.cache:
            layer.filter(idx)
        self.seqs = [self.seqs[i] for i in keep]
        self.last_tokens = [self.last_tokens[i] for i in keep]
