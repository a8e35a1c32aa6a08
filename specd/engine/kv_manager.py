"""A Model's KV memory as a budget: what its rows hold, who may join, who must make room.

Rows take memory as they grow (``core.kv.RowKV`` buffers, ``STEP`` columns at
a time), and give it back when they leave: nothing is reserved up front, so a
Model that serves short requests holds little. The budget (``kvCache.maxBytes``)
bounds the sum. A row counts only the tokens it holds itself: a cached prefix it
reads in place is the prefix cache's, held once however many rows read it, and
counted under that budget. The manager models what a row of n tokens holds, so
the scheduler decides before each step, not after an allocation fails:

- a waiting request is admitted only if its prompt fits beside the running rows,
  every row with a round's growth (``ROUND_GROWTH`` columns: k + 1 tokens, a
  draft tree's nodes, grammar-forced tokens);
- before a decode round, the rows that joined last are preempted until every
  row can grow by a round. A preempted request goes back to the front of the
  queue with its tokens and is recomputed from them (the prefix cache usually
  holds most: what the row held is recorded as it leaves), so its output does
  not change;
- no row may outgrow the budget alone: ``max_tokens`` caps the Model's context;
- what the budget has left beside the rows (``room``) may pad shorter rows to
  the longest, where attention runs faster over the rows as one block
  (``core.kv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..core.columns import STEP

ROUND_GROWTH = STEP  # columns a row may write in one decode round
UNBOUNDED = 1 << 62  # tokens: a model that keeps no per-token state


@dataclass
class KVManager:
    """The budget and the model of one row's memory: the target's and the
    drafter's (bytes per token in every attention layer, bytes of recurrent
    state), ``core.cache.kv_bytes``."""

    max_bytes: int
    target: tuple[int, int]
    drafter: tuple[int, int] = (0, 0)
    preemptions: int = 0
    held_bytes: int = 0  # what the rows really held at the last step (engine thread writes, anyone reads)
    peak_bytes: int = 0  # the most they held at the end of a step
    shared_tokens: int = 0  # tokens the rows read in place from the prefix cache at the last step

    def held(self, nbytes: int, shared_tokens: int) -> None:
        """What the rows hold now (measured from their buffers), and read in place from the prefix cache."""
        self.held_bytes = nbytes
        self.peak_bytes = max(self.peak_bytes, nbytes)
        self.shared_tokens = shared_tokens

    @property
    def token_bytes(self) -> int:
        return self.target[0] + self.drafter[0]

    @property
    def state_bytes(self) -> int:
        return self.target[1] + self.drafter[1]

    def row_bytes(self, tokens: int) -> int:
        """What a row of ``tokens`` tokens may hold by the end of a round."""
        return -(-(tokens + ROUND_GROWTH) // STEP) * STEP * self.token_bytes + self.state_bytes

    def fits(self, lengths: Iterable[int]) -> bool:
        """Whether rows of these lengths fit the budget, each after a round."""
        return sum(self.row_bytes(n) for n in lengths) <= self.max_bytes

    def room(self, lengths: Iterable[int]) -> int:
        """Columns of every layer's padding the budget holds beside rows of these lengths, each
        after a round: what a block layout may pad shorter rows with (``RowKV.room``)."""
        if not self.token_bytes:
            return UNBOUNDED
        return max(0, self.max_bytes - sum(self.row_bytes(n) for n in lengths)) // self.token_bytes

    @property
    def max_tokens(self) -> int:
        """The longest row the budget holds alone."""
        if not self.token_bytes:
            return UNBOUNDED
        return max(0, (self.max_bytes - self.state_bytes) // self.token_bytes // STEP * STEP - ROUND_GROWTH)

    def status(self) -> dict:
        """What ``describe model`` shows (read from any thread)."""
        return {"maxBytes": self.max_bytes, "bytes": self.held_bytes, "peakBytes": self.peak_bytes,
                "tokenBytes": self.token_bytes,
                "maxTokens": None if self.max_tokens == UNBOUNDED else self.max_tokens,
                "reserved": False, "preemptions": self.preemptions, "sharedTokens": self.shared_tokens}


def default_max_bytes(host_memory: int, weights: int, rows: KVManager, max_rows: int, max_context: int,
                      room: int | None = None) -> int:
    """The KV budget of a Model that names none: what ``max_rows`` rows of
    ``max_context`` tokens would need, capped by half of the host's memory left
    after the weights (a 16 GB Mac keeps room for the OS and other Models; a
    512 GB one gives a large Model its whole batch) and by ``room`` (what the
    Model's ``resources.memory`` leaves it), and never less than one row of
    ``STEP`` tokens; a row as ``rows`` models it."""
    need = max_rows * rows.row_bytes(max_context)
    cap = max(0, host_memory - weights) // 2
    if room is not None:
        cap = min(cap, room)
    return max(rows.row_bytes(STEP), min(need, cap))
