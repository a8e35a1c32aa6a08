"""Prompt-lookup (n-gram) proposals with an incremental per-sequence index.

For each sequence, the last n tokens (n from ``max_n`` down to ``min_n``) are
looked up among earlier positions of its prompt + output, most recent match
first, and the tokens that followed that match are proposed.  The index is
updated with each new token, so a proposal costs O(max_n - min_n), not
O(context).
"""

from __future__ import annotations

from ..core.sequence import Sequence
from ..core.request import Method, SpeculationConfig
from .proposer import Drafts, Outcome, Round


class NgramIndex:
    """Most recent end position of every n-gram (min_n..max_n) of one sequence.

    The n-grams that end at the newest token are indexed one token late, so a
    lookup of the current suffix finds an *earlier* occurrence, never itself.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens[:indexed] have all their n-grams in last_end

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        # Index n-grams that end at positions < len(tokens) - 1 ... keep the newest out.
        upto = len(self.tokens) - 1
        for end in range(max(self.indexed, 1), upto + 1):
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    self.last_end[tuple(self.tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto + 1)

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            end = self.last_end.get(tuple(toks[len(toks) - n:]))
            if end is not None:
                return toks[end:end + k]
        return []


class NgramProposer:
    """Prompt lookup for every n-gram row: an index per sequence, made on its first round."""

    method = Method.NGRAM
    caught_up = False  # the index catches up on the host: nothing to bill
    backlog_seconds = 0.0

    def __init__(self) -> None:
        self.indexes: dict[Sequence, NgramIndex] = {}

    def can_draft(self, seq: Sequence) -> bool:
        return True

    def prefilled(self, seqs: list[Sequence], specs: list[SpeculationConfig], columns: list[list[int]],
                  started: bool) -> None:
        """Lookups read the sequence's tokens; prefill adds none."""

    def propose(self, round_: Round) -> Drafts:
        out = Drafts()
        for i in round_.rows(self.method):
            if round_.ks[i]:
                found = self.lookup(round_.seqs[i], round_.specs[i], round_.ks[i])
                if found:
                    out.chains[i] = found
        return out

    def lookup(self, seq: Sequence, spec: SpeculationConfig, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's suffix."""
        index = self.indexes.get(seq)
        if index is None:
            index = self.indexes[seq] = NgramIndex(spec.ngram_min, spec.ngram_max)
            index.extend(seq.prompt)
        unseen = seq.context_length - len(index.tokens)
        index.extend(seq.tokens[len(seq.tokens) - unseen:])
        return index.propose(k)

    def commit(self, round_: Round, outcome: Outcome) -> None:
        """The index reads accepted tokens from the sequence at the next lookup."""

    def settle(self) -> None:
        """Nothing on the device."""

    def release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.indexes.pop(seq, None)
