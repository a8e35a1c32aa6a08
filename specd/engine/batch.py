"""The running batch: sequences and their per-layer batched KV cache, kept in step.

Rows of the cache are left-padded (mlx-lm's ``BatchKVCache`` convention): the
newest token of every sequence sits at the same column, the mask hides each
row's padding, and RoPE positions come from each row's own offset.  That is
what lets sequences of different lengths decode together, join between steps
(``extend``) and leave (``filter``), and what makes per-sequence rollback
exact: a row's rejected tail is rolled to the front and becomes padding.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .sequence import Sequence


def make_batch_cache(model: nn.Module, left_padding: list[int]) -> list[BatchKVCache]:
    """One ``BatchKVCache`` per layer; refuses models whose caches cannot batch."""
    layers = make_prompt_cache(model)
    kinds = {type(c) for c in layers}
    if kinds != {KVCache}:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise ValueError(f"continuous batching needs plain KV caches; this model uses {names}")
    return [BatchKVCache(list(left_padding)) for _ in layers]


def rollback(cache: list[BatchKVCache], rejected: list[int]) -> None:
    """Drop the last ``rejected[b]`` cached tokens of row b, for every layer.

    The rows are rolled right so the dropped tail becomes left padding (what
    ``BatchKVCache.prepare(right_padding=...)``/``finalize()`` do for prompts):
    each row then holds exactly its accepted tokens and no row is truncated
    because of another.
    """
    if not any(rejected):
        return
    for layer in cache:
        layer.prepare(right_padding=rejected)
        layer.finalize()


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
