"""What the scheduler hands the model runner: the work of one step, decided before it runs.

Every step the scheduler plans (``Scheduler.step``) and the runner executes
(``ModelRunner``), as vLLM v1 divides its scheduler's output and its model
runner: first a ``PrefillChunk`` (which newcomers run which prompt columns),
then a ``DecodeStep`` (the batch's rows, newcomers whose last chunk just ran
among them, and how many tokens each proposes: the draft and verify widths,
the speculation controller's k per row). The scheduler decides who is in the
batch and what each row runs; the runner forwards, samples or verifies, and
rolls the caches back.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..core.batch import RunningBatch
from ..core.cache import RowCache
from ..core.sequence import Sequence
from ..speculation.proposer import Round


@dataclass
class PrefillGroup:
    """Newcomers whose prompts are being prefilled together, chunk by chunk."""

    seqs: list[Sequence]
    contexts: list[list[int]]  # what each row prefills, as the prefix cache knows it (Sequence.prefill_keys)
    tokens: mx.array  # (B, L) left-padded contexts
    cache: RowCache
    start: int = 0  # the first column run (cached prefixes end here)
    done: int = 0  # columns already in the cache

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def padding(self) -> list[int]:
        """Each row's left padding."""
        return [self.width - len(c) for c in self.contexts]


@dataclass
class PrefillChunk:
    """Columns [start, end) of a prefill group's left-padded contexts, to run this step."""

    group: PrefillGroup
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.start == self.group.start

    @property
    def last(self) -> bool:
        return self.end == self.group.width


@dataclass
class DecodeStep:
    """The running batch's decode step: its rows, and each row's speculation and planned k."""

    batch: RunningBatch
    round: Round




@dataclass(frozen=True)
class ChunkSizes:
    """How many prompt tokens a prefill chunk runs: ``step_tokens`` while rows decode, so
    that they keep flowing; at least ``alone_tokens`` while none does, as larger chunks run
    faster (``ops/bench/prefill.py``) and no row waits for them. A model with recurrent state
    keeps its chunks (``stateful``): the prefix cache can resume it only where a chunk ended,
    and its disk tier only where a block of ``disk_block`` tokens ends."""

    step_tokens: int
    alone_tokens: int
    stateful: bool = False
    disk_block: int | None = None  # a stateful model's disk tier's block

    def tokens(self, decoding: bool) -> int:
        """Tokens a chunk runs in all, with rows ``decoding`` or none."""
        if decoding or self.stateful:
            return self.step_tokens
        return max(self.step_tokens, self.alone_tokens)

    def columns(self, rows: int, decoding: bool) -> int:
        """Columns of each row a chunk of a group of ``rows`` rows runs."""
        return max(1, self.tokens(decoding) // rows)

    def next_chunk(self, group: PrefillGroup | None, decoding: bool) -> PrefillChunk | None:
        """The group's next chunk (None: nothing left to run, or no group)."""
        if group is None or group.done == group.width:  # a one-token prompt, or a context all cached
            return None
        end = min(group.width, group.done + self.columns(len(group.seqs), decoding))
        if self.disk_block is not None and len(group.seqs) == 1 and end < group.width:
            aligned = end // self.disk_block * self.disk_block  # resumable from disk: end where a block ends
            end = aligned if aligned > group.done else end
        return PrefillChunk(group, group.done, end)
