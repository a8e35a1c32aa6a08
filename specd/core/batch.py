"""The running batch: sequences and the target's cache rows, kept in step."""

from __future__ import annotations

from .cache import RowCache
from .sequence import Sequence


class RunningBatch:
    """Sequences that decode together, row b of the cache belonging to seqs[b]."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.cache: RowCache | None = None
        self.last_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.seqs)

    def extend(self, seqs: list[Sequence], cache: RowCache, last_tokens: list[int]) -> None:
        """Add freshly prefilled sequences (their cache rows come along)."""
        if not self.seqs:
            self.seqs, self.cache, self.last_tokens = list(seqs), cache, list(last_tokens)
            return
        self.cache.merge(cache)
        self.seqs.extend(seqs)
        self.last_tokens.extend(last_tokens)

    def keep(self, keep: list[int]) -> list[Sequence]:
        """Keep only rows ``keep``; returns the sequences that left."""
        if len(keep) == len(self.seqs):
            return []
        kept = set(keep)
        left = [s for i, s in enumerate(self.seqs) if i not in kept]
        if not keep:
            self.seqs, self.cache, self.last_tokens = [], None, []
            return left
        self.cache.select(keep)
        self.seqs = [self.seqs[i] for i in keep]
        self.last_tokens = [self.last_tokens[i] for i in keep]
        return left
