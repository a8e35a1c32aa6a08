"""The model runner: the one place a step's forward runs, then the logits
processors, then the sampler or the verifier.

Every forward of the target goes through it, over a batch's ``RowCache``:

- a prefill chunk (``prefill``): the forward over every token of a row's
  context but the last, for its keys and values only (no logits);
- a decode step (``decode``): the speculator proposes (nothing, when no row
  speculates), the runner forwards ``[last, proposals...]`` per row (or every
  row's draft tree, with ancestor-only attention), ``last`` being its
  context's last token (so a row that just joined samples its first token
  here, with the batch's), processes the logits, and then samples one token
  per row or, when some row proposed, hands them to the speculator's
  verifier, which keeps a prefix of each row's proposals and rolls the
  caches back to exactly that.

The logits processors, in this order: each row's ``logit_bias`` and
presence, frequency and repetition penalties (``adjust_logits``, every
position with its own context), then its grammar's mask (``mask_logits``),
so a speculating row and a plain one are decided by the same distribution.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..core.batch import RunningBatch
from ..core.cache import RowCache
from ..core.grammar import mask_logits
from ..core.sampling import adjust_logits
from ..core.sequence import Sequence, sample_tokens
from ..speculation.speculator import Speculator

# Hands a step's tokens to the requests: deliver(seqs, logits, emitted), logits[b, j] produced emitted[b][j].
Deliver = Callable[[list[Sequence], mx.array, list[list[int]]], None]


class ModelRunner:
    """Runs the target's steps for one engine; the speculator decides what is proposed and what is kept."""

    def __init__(self, model: nn.Module, speculator: Speculator):
        self.model = model
        self.speculator = speculator

    def prefill(self, cache: RowCache, inputs: mx.array) -> None:
        """One prefill chunk of a group's rows: their keys and values only. Its logits are
        never evaluated (lazy, they cost nothing): a context's last token is fed by the
        decode step, as mlx-lm's generators feed it apart from the prompt."""
        cache.forward(self.model, inputs)

    def process(self, logits: mx.array, seqs: list[Sequence], inputs: mx.array | None = None,
                ancestry: mx.array | None = None, drafts: list[list[int]] | None = None,
                columns: list[list[int]] | None = None) -> mx.array:
        """The logits processors over (B, N, V) logits: position j of row b is
        decided after ``inputs[b, :j + 1]`` (its proposals before it, or its
        tree ``ancestry``), and a grammar is walked through ``drafts`` (laid
        out at ``columns`` in a tree)."""
        logits = adjust_logits(logits, [s.params for s in seqs], [s.prompt for s in seqs], [s.tokens for s in seqs],
                               inputs, ancestry)
        return mask_logits(logits, [s.constraint for s in seqs], drafts or [[] for _ in seqs], columns)

    def decode(self, batch: RunningBatch, deliver: Deliver) -> None:
        """One decode step for the running batch; ``deliver`` hands each row its tokens."""
        step_started = time.perf_counter()
        seqs, speculator = batch.seqs, self.speculator
        proposal = speculator.propose(seqs, batch.last_tokens)
        width = proposal.width
        if proposal.tree is not None:
            inputs = mx.array(proposal.tree.inputs)
        else:
            inputs = mx.array([[t] + d + [0] * (width - len(d)) for t, d in zip(batch.last_tokens, proposal.drafts)])
        started = time.perf_counter()
        with speculator.verify_context(batch.cache, proposal):
            logits = batch.cache.forward(self.model, inputs, provisional=width > 0)
        if any(s.constraint for s in seqs):  # the forward runs while the grammars fill their masks
            mx.async_eval(logits)
        tree = proposal.tree
        logits = self.process(logits, seqs, inputs, None if tree is None else mx.array(tree.ancestry),
                              proposal.drafts, None if tree is None else [[0] + c for c in tree.columns])
        if width == 0:
            emitted = [[t] for t in sample_tokens(seqs, logits[:, -1, :])]
            speculator.after_plain_step(seqs, proposal, emitted)
        else:
            emitted, logits = speculator.verify(batch, logits, proposal)
        forward_seconds = time.perf_counter() - started  # verification and rollback included
        deliver(seqs, logits, emitted)
        speculator.observe_round(len(batch), width, forward_seconds, time.perf_counter() - step_started,
                                 proposal.caught_up)
        batch.last_tokens = [e[-1] for e in emitted]
