"""Draft-model proposals: a small model drafts k tokens for every speculating row.

The draft keeps its own batched KV cache whose rows follow the sequences that
speculate with it.  A row is prefilled lazily, on its sequence's first
speculation round.  Between rounds each row holds ``pending`` tokens the draft
has not seen yet (the target's correction or bonus token, plus the last draft
token when all k were accepted); the first draft step feeds them right-padded
and rolls the padding back, so every row's draft cache holds exactly its
accepted context, like the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..engine.batch import make_batch_cache, rollback
from ..engine.sampling import SamplingParams, sample_rows

GREEDY = SamplingParams(temperature=0)
from ..engine.sequence import Sequence


@dataclass
class DraftProposal:
    drafts: mx.array  # (B, K) tokens
    probs: mx.array | None  # (S, K, V) q of the sampling rows that drafted, in row order (greedy rows need none)
    keys: list[mx.array]  # advanced RNG keys of the rows


class DraftModelProposer:
    method = "draft"

    def __init__(self, model: nn.Module):
        self.model = model
        self.rows: list[Sequence] = []
        self.cache: list = []
        self.pending: list[list[int]] = []
        self._drafted = 0
        self._drafting: list[bool] = []  # rows that drafted in the current step
        self.caught_up = False  # the last propose prefilled rows or fed a backlog: a one-off cost in its time

    def _forward(self, tokens: list[list[int]]) -> mx.array:
        """Feed each row its tokens (right-padded); return each row's last logits."""
        width = max(len(t) for t in tokens)
        inputs = mx.array([t + [0] * (width - len(t)) for t in tokens])
        logits = self.model(inputs, cache=self.cache)
        last = mx.array([len(t) - 1 for t in tokens])
        rollback(self.cache, [width - len(t) for t in tokens])
        return logits[mx.arange(len(tokens)), last]

    def _admit(self, seqs: list[Sequence], last_tokens: list[int]) -> None:
        """Prefill the draft cache for sequences it has not seen yet."""
        context = [s.prompt + s.tokens[:-1] for s in seqs]
        width = max(len(c) for c in context)
        padding = [width - len(c) for c in context]
        cache = make_batch_cache(self.model, padding)
        self.model(mx.array([[0] * p + c for p, c in zip(padding, context)]), cache=cache)
        mx.eval([c.state for c in cache])
        if self.rows:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
        else:
            self.cache = cache
        self.rows += seqs
        self.pending += [[t] for t in last_tokens]

    def _select(self, rows: list[int]) -> None:
        """Keep (and reorder to) the given cache rows."""
        if rows == list(range(len(self.rows))):
            return
        drafting = self._drafting if len(self._drafting) == len(self.rows) else [False] * len(self.rows)
        self._drafting = [drafting[i] for i in rows]
        self.rows = [self.rows[i] for i in rows]
        self.pending = [self.pending[i] for i in rows]
        if rows:
            idx = mx.array(rows)
            for layer in self.cache:
                layer.filter(idx)
        else:
            self.cache = []

    def retain(self, alive: set[int]) -> None:
        """Drop the rows of sequences (by ``id``) that are no longer running."""
        self._select([i for i, s in enumerate(self.rows) if id(s) in alive])

    def _sync_rows(self, seqs: list[Sequence], last_tokens: list[int]) -> int:
        """Make the cache rows exactly ``seqs``, in order: drop sequences that
        left or stopped drafting, prefill newcomers (returns how many)."""
        self.retain({id(s) for s in seqs})
        known = {id(s) for s in self.rows}
        new = [(s, t) for s, t in zip(seqs, last_tokens) if id(s) not in known]
        if new:
            self._admit([s for s, _ in new], [t for _, t in new])
        row_of = {id(s): i for i, s in enumerate(self.rows)}
        self._select([row_of[id(s)] for s in seqs])
        return len(new)

    @property
    def known(self) -> set[int]:
        return {id(s) for s in self.rows}

    def propose(self, seqs: list[Sequence], last_tokens: list[int], drafting: list[bool], k: int,
                params: list[SamplingParams], keys: list[mx.array]) -> DraftProposal:
        """Draft ``k`` tokens for the ``drafting`` rows of ``seqs``; rows are then exactly ``seqs``.

        Rows not drafting this step still catch up on their pending tokens in
        the first forward (so resuming later needs no new prefill); their draft
        steps are discarded and do not consume their RNG.
        """
        admitted = self._sync_rows(seqs, last_tokens)
        # a round feeds a row one or two pending tokens, three after a plain step
        # in between (as a controller's try interleaves them); more is a backlog
        self.caught_up = admitted > 0 or max(map(len, self.pending)) > 3
        self._drafting = list(drafting)
        params = [p if d else GREEDY for p, d in zip(params, drafting)]
        new_keys = list(keys)
        drafts, probs = [], []
        logits = self._forward(self.pending)
        for step in range(k):
            token, new_keys, logprobs = sample_rows(logits, params, new_keys)
            drafts.append(token)
            if logprobs is not None:
                probs.append(mx.exp(logprobs))
            if step < k - 1:
                logits = self.model(token[:, None], cache=self.cache)[:, -1]
        self._drafted = k
        return DraftProposal(mx.stack(drafts, axis=1), mx.stack(probs, axis=1) if probs else None, new_keys)

    def commit(self, accepted: list[int], drafts: list[list[int]], next_tokens: list[int]) -> None:
        """Roll each row back to its accepted context and queue what it must see next.

        After k draft steps a row's cache holds pending + d_1..d_{k-1}.  Keeping
        a accepted drafts means dropping k-1-a of them; when all k were accepted
        d_k was never fed, so it goes into pending ahead of the target's token.
        Rows that did not draft keep only their caught-up context; what they
        emit is queued by ``observe``.  Arguments are for the drafting rows, in order.
        """
        k = self._drafted
        rejected = [k - 1] * len(self.rows)
        results = iter(zip(accepted, drafts, next_tokens))
        for i, drafting in enumerate(self._drafting):
            if drafting:
                a, d, t = next(results)
                rejected[i] = max(k - 1 - a, 0)
                self.pending[i] = [d[k - 1], t] if a == k else [t]
            else:
                self.pending[i] = []
        rollback(self.cache, rejected)

    def observe(self, emitted: dict[int, list[int]]) -> None:
        """Queue the tokens each non-drafting row emitted this step (by sequence ``id``)."""
        for i, seq in enumerate(self.rows):
            if not self._drafting[i] and id(seq) in emitted:
                self.pending[i] += emitted[id(seq)]
        self._drafting = [False] * len(self.rows)
