"""The proposer interface: n-gram lookup, a draft model and an EAGLE head
propose the same way, and the rows of a drafter's cache follow the batch.

Proposers only propose.  Each round the speculator hands every attached
proposer the batch's rows with the k the controller planned per row
(``Round``); a proposer drafts for the rows of its own method and returns
chains (with the draft distribution q where it has one) or branching trees
(``Drafts``).  After verification every proposer learns what each row kept
(``Outcome``) and brings its own state to exactly the accepted context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import mlx.core as mx

from ..core.cache import RowCache
from ..core.sequence import Sequence
from ..core.request import Method, SpeculationConfig
from .tree import DraftTree, TreeLayout


@dataclass
class Round:
    """The batch as the proposers see it this round."""

    seqs: list[Sequence]
    last_tokens: list[int]
    specs: list[SpeculationConfig]  # each row's speculation (its request's, else the model's)
    ks: list[int]  # proposals planned per row (0: the row does not draft this round)
    # rows of a draft model that propose a prompt lookup instead this round (it covers their k)
    lookups: dict[int, list[int]] = field(default_factory=dict)

    def rows(self, method: Method) -> list[int]:
        """Rows that use ``method``, drafting this round or not."""
        return [i for i, spec in enumerate(self.specs) if spec.method == method]

    @property
    def model_ks(self) -> list[int]:
        """What a draft model drafts per row: the planned k, but nothing for a row proposing a lookup."""
        return [0 if i in self.lookups else k for i, k in enumerate(self.ks)]


@dataclass
class Drafts:
    """What proposers offered, by batch row."""

    chains: dict[int, list[int]] = field(default_factory=dict)
    q: dict[int, mx.array] = field(default_factory=dict)  # sampling rows of a draft model: (k, V) q
    trees: dict[int, DraftTree] = field(default_factory=dict)  # rows offered a branching tree
    shape: tuple[int, int] | None = None  # (rows, steps) a draft model or head ran: its cost model's input


@dataclass
class Outcome:
    """What the round kept, by batch row."""

    accepted: list[int]  # proposals accepted
    emitted: list[list[int]]  # accepted proposals plus the target's next token
    kept_columns: list[list[int]]  # the verify forward's columns that stay in the cache
    # a plain step's target features, taken when its forward was built (it may have run ahead of
    # the step being committed); None: the last forward's
    features: mx.array | None = None


@dataclass
class Proposal:
    """A round's proposals, as the target's verify forward takes them."""

    round: Round
    drafts: list[list[int]]  # per row, possibly empty (a branching tree row: empty, see ``trees``)
    offered: Drafts
    caught_up: bool = False  # a drafter caught rows up (a prefill or a backlog): a one-off cost in the step
    backlog_seconds: float = 0.0  # what drafters spent feeding rows a backlog, timed apart: not the step's cost
    tree: TreeLayout | None = None  # set when some row proposes a branching tree
    trees: list[DraftTree] | None = None  # every row's proposal as a tree (chains are linear)
    forced: list[int] | None = None  # per row, tokens its grammar forced at the end of its chain
    cut: list[int] | None = None  # per row, proposed tokens its grammar rejected before verification

    @property
    def drafted(self) -> list[int]:
        """Per row, the proposers' tokens (a tree: its depth), forced ones left out."""
        if self.trees is not None:
            lengths = [max(t.depths(), default=0) for t in self.trees]
        else:
            lengths = [len(d) for d in self.drafts]
        return lengths if self.forced is None else [n - f for n, f in zip(lengths, self.forced)]

    @property
    def forced_only(self) -> list[int]:
        """Per row, its forced tokens when it proposed nothing else (they are
        accepted with certainty), else 0."""
        if self.forced is None:
            return [0] * len(self.drafts)
        return [f if d == 0 else 0 for d, f in zip(self.drafted, self.forced)]

    @property
    def width(self) -> int:
        """Proposal columns the verify forward adds to each row."""
        if self.tree is not None:
            return self.tree.width - 1
        return max((len(d) for d in self.drafts), default=0)

    @property
    def inputs(self) -> list[list[int]]:
        """The verify forward's tokens per row: the tree's layout, or ``[last, d_1..d_k]`` right-padded."""
        if self.tree is not None:
            return self.tree.inputs
        width = self.width
        return [[t] + d + [0] * (width - len(d)) for t, d in zip(self.round.last_tokens, self.drafts)]


class Proposer(Protocol):
    method: Method
    caught_up: bool  # the last propose fed a row its whole context or a backlog: a one-off cost
    backlog_seconds: float  # what the last propose spent feeding a backlog it timed apart (0: none, or not apart)

    def can_draft(self, seq: Sequence) -> bool:
        """Whether the proposer holds everything it needs to draft for ``seq`` now."""

    def prefilled(self, seqs: list[Sequence], specs: list[SpeculationConfig], columns: list[list[int]],
                  started: bool) -> None:
        """A prefill chunk of the target kept ``columns[b]`` of row b (``started``: its first chunk)."""

    def propose(self, round_: Round) -> Drafts:
        """Draft for the rows of this proposer's method whose planned k is positive."""

    def commit(self, round_: Round, outcome: Outcome) -> None:
        """Bring the proposer's state to each row's accepted context (called every round)."""

    def settle(self) -> None:
        """Evaluate what ``commit`` left lazy, so this round pays for it."""

    def release(self, seqs: list[Sequence]) -> None:
        """Forget sequences that left the batch."""


State = TypeVar("State")


class FollowedRows(Generic[State]):
    """The rows of a drafter's own batched cache, following the batch's
    sequences: one entry of per-sequence state each, in cache-row order."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.state: dict[Sequence, State] = {}
        self.cache: RowCache | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self.state

    def add(self, entries: list[tuple[Sequence, State]], cache: RowCache) -> None:
        """Append newly prefilled rows (``cache`` holds just theirs)."""
        if self.seqs:
            self.cache.merge(cache)
        else:
            self.cache = cache
        for seq, state in entries:
            self.seqs.append(seq)
            self.state[seq] = state

    def follow(self, seqs: list[Sequence]) -> list[Sequence]:
        """Keep the rows of ``seqs`` that are here; returns those that are not (yet)."""
        wanted = set(seqs)
        self._select([i for i, s in enumerate(self.seqs) if s in wanted])
        return [s for s in seqs if s not in self.state]

    def order(self, seqs: list[Sequence]) -> None:
        """Reorder the rows to ``seqs`` exactly (every one must be here)."""
        row_of = {s: i for i, s in enumerate(self.seqs)}
        self._select([row_of[s] for s in seqs])

    def release(self, seqs: list[Sequence]) -> None:
        gone = set(seqs)
        if any(s in self.state for s in gone):
            self._select([i for i, s in enumerate(self.seqs) if s not in gone])

    def _select(self, rows: list[int]) -> None:
        if rows == list(range(len(self.seqs))):
            return
        kept = [self.seqs[i] for i in rows]
        self.state = {s: self.state[s] for s in kept}
        self.seqs = kept
        if rows:
            self.cache.select(rows)
        else:
            self.cache = None
