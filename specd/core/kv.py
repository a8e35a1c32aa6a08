"""Batched attention caches with exact per-row rollback.

Rows are left-padded (mlx-lm's ``BatchKVCache`` convention): the newest token
of every sequence sits at the same column, the mask hides each row's padding,
and RoPE positions come from each row's own offset.  A row's rejected tail is
hidden from attention and positions at once, and squeezed out into left
padding later (``SpeculativeKVCache``).  A sliding window is the same cache
with a window applied in each row's own positions and the columns no future
token can see evicted now and then, so a rejected proposal never evicts
anything its replacement still needs.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache


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

    ``window`` (sliding-window attention, mlx-lm's ``RotatingKVCache``): a
    token sees the ``window`` most recent positions of its row, itself
    included.  Columns are kept until ``evict`` drops those no future token
    can see, so rollback within a window is as exact as without one.
    """

    COMPACT_FRACTION = 0.25
    EVICT_SLACK = 16  # columns past twice the window before evicting

    def __init__(self, left_padding: list[int], window: int | None = None):
        super().__init__(left_padding)
        self.window = window
        self.valid: mx.array | None = None
        self.holes: np.ndarray | None = None  # (B,) hidden columns per row, while ``valid`` is set
        self.tree: mx.array | None = None  # (B, N, N) ancestry of the N tokens being verified as a tree

    def update_and_fetch(self, keys, values):
        if self.valid is not None:
            self.valid = mx.concatenate(
                [self.valid, mx.ones((self.valid.shape[0], keys.shape[2]), dtype=mx.bool_)], axis=1)
        return super().update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        windows = [w for w in (self.window, window_size) if w]
        window = min(windows) if windows else None
        plain = self.valid is None and self.tree is None
        if (plain and not return_array and window is None and self.left_padding.shape[0] == 1
                and self.left_padding.item() == 0):
            return None if N == 1 else "causal"  # a lone unpadded row needs no mask array (a faster path)
        if plain:  # columns are positions (up to each row's padding): mlx-lm's mask applies the window
            return super().make_mask(N, return_array=True, window_size=window, **kwargs)
        mask = super().make_mask(N, return_array=True, **kwargs)
        live = self._live()
        if self.valid is not None:
            mask = mask & mx.concatenate([live, mx.ones((live.shape[0], N), dtype=mx.bool_)], axis=1)[:, None, None]
        if self.tree is not None:  # each new token sees the context and its own ancestors only
            mask = mx.concatenate([mask[..., :-N], mask[..., -N:] & self.tree[:, None]], axis=-1)
        if window is not None:
            mask = mask & self._window_mask(live, N, window)[:, None]
        return mask

    def _live(self) -> mx.array:
        """(B, _idx): the columns each row holds a token in (not padding, not a hole)."""
        cols = mx.arange(self._idx)[None, :]
        live = cols >= self.left_padding[:, None]
        return live if self.valid is None else live & self.valid

    def _window_mask(self, live: mx.array, N: int, window: int) -> mx.array:
        """(B, N, _idx + N): which columns each new token's window reaches,
        counted in the row's own positions, holes skipped; a new token's
        position is its depth in the draft tree (its index in a chain)."""
        if self.tree is None:
            depth = mx.arange(N)[None, :]
        else:
            depth = self.tree.sum(axis=-1) - 1
        after = _live_after(live)
        old = (after[:, None, :] + 1 + depth[..., None]) < window  # (B, N, _idx)
        new = (depth[..., None] - depth[:, None, :]) < window
        return mx.concatenate([old, mx.broadcast_to(new, (old.shape[0], N, N))], axis=-1)

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
        self._gather(self._live())
        self.valid = self.holes = None

    def _gather(self, live: mx.array) -> None:
        """Keep each row's ``live`` columns, right-aligned in order, and drop
        the padding every row has in front.  A row of a prefill group whose
        prompt starts in a later chunk keeps the padding still to be written."""
        n = self._idx
        unwritten = mx.maximum(self.left_padding - n, 0)
        order = mx.argsort(live.astype(mx.int32) * n + mx.arange(n)[None, :], axis=1)  # dead first, live in order
        index = order[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys[..., :n, :], index, axis=2)
        self.values = mx.take_along_axis(self.values[..., :n, :], index, axis=2)
        self.left_padding = n - live.sum(axis=1) + unwritten
        front = min(int(self.left_padding.min().item()), n)
        self.keys, self.values = self.keys[..., front:, :], self.values[..., front:, :]
        self._idx -= front
        self.left_padding = self.left_padding - front

    def needs_eviction(self) -> bool:
        """Whether a window's cache holds so many columns that evicting pays
        (about one gather per ``window`` steps)."""
        return self.window is not None and self._idx > 2 * self.window + self.EVICT_SLACK

    def evict(self) -> None:
        """Drop every column no future token can see: each row keeps its
        ``window - 1`` newest tokens (and its holes go too)."""
        live = self._live()
        self._gather(live & (_live_after(live) < self.window - 1))
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


def _live_after(live: mx.array) -> mx.array:
    """(B, n): how many live columns follow each column in its row."""
    return live.sum(axis=1, keepdims=True) - mx.cumsum(live.astype(mx.int32), axis=1)
