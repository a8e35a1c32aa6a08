"""Draft-model proposals: a small model drafts k tokens for every speculating row.

The draft keeps its own batched cache whose rows follow the sequences that
speculate with it.  A row is prefilled lazily, on its sequence's first
speculation round.  Between rounds each row holds ``pending`` tokens the draft
has not seen yet (the target's correction or bonus token, plus the last draft
token when all k were accepted); the first draft step feeds them right-padded
and rolls the padding back, so every row's draft cache holds exactly its
accepted context, like the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..core import dispatch
from ..core.cache import kv_bytes, make_row_cache
from ..core.prefix import RowPrefixes, common_prefix
from ..core.grammar import Constraint, mask_logits
from ..core.sampling import SamplingParams, adjust_logits, sample_rows
from ..core.sequence import Sequence
from ..core.request import Method, SpeculationConfig
from .proposer import Drafts, FollowedRows, Outcome, Round

GREEDY = SamplingParams(temperature=0)


@dataclass
class DraftRow:
    pending: list[int]  # tokens the draft has not been fed yet
    drafting: bool = False  # drafted in the current round
    drafted: list[int] = field(default_factory=list)  # what it drafted then


class DraftModelProposer:
    method = Method.DRAFT

    def __init__(self, model: nn.Module, prefixes: RowPrefixes):
        self.model = model
        self.prefixes = prefixes  # the draft's own cached prefixes
        self.row_bytes = kv_bytes(model)  # one row's (bytes per token, recurrent state bytes)
        self.rows: FollowedRows[DraftRow] = FollowedRows()
        self._drafted = 0  # k of the current round (0: the proposer did not run)
        self.caught_up = False
        self.backlog_seconds = 0.0  # its backlog (pending tokens) is fed with the drafting: a caught-up round

    def can_draft(self, seq: Sequence) -> bool:
        return True

    def prefilled(self, seqs: list[Sequence], specs: list[SpeculationConfig], columns: list[list[int]],
                  started: bool) -> None:
        """The draft prefills lazily, on a sequence's first round."""

    def release(self, seqs: list[Sequence]) -> None:
        """Record what leaving rows hold (all they were fed but their pending tokens)."""
        for seq in seqs:
            if seq in self.rows:
                held = len(seq.prompt) + seq.produced - len(self.rows.state[seq].pending)
                self.prefixes.record(seq, seq.prompt + seq.tokens, held, self.rows.cache, self.rows.seqs.index(seq),
                                     prompt=len(seq.prompt))
            self.prefixes.release(seq)
        self.rows.release(seqs)

    def _forward(self, tokens: list[list[int]]) -> mx.array:
        """Feed each row its tokens (right-padded); return each row's last logits."""
        width = max(len(t) for t in tokens)
        inputs = mx.array([t + [0] * (width - len(t)) for t in tokens])
        logits = self.rows.cache.forward(self.model, inputs, provisional=True)
        last = mx.array([len(t) - 1 for t in tokens])
        self.rows.cache.rollback([width - len(t) for t in tokens])
        return logits[mx.arange(len(tokens)), last]

    def _admit(self, seqs: list[Sequence], last_tokens: list[int]) -> None:
        """Prefill the draft cache for sequences it has not seen yet, each
        from the longest prefix the draft's cache tree holds."""
        context = [s.prefill_tokens for s in seqs]
        run, cached = self.prefixes.plan(context)
        starts = self.prefixes.start(list(zip(seqs, context, cached)))
        cache = make_row_cache(self.model, [max(0, run - len(c)) for c in context], starts)
        if run:  # nothing to run: one-token prompts
            cache.forward(self.model, mx.array([([0] * run + c)[-run:] for c in context]))
        for b, (s, c) in enumerate(zip(seqs, context)):
            self.prefixes.record(s, c, len(c), cache, b, prompt=len(s.prompt))
        mx.eval(cache.state)
        self.rows.add([(s, DraftRow([t])) for s, t in zip(seqs, last_tokens)], cache)

    def propose(self, round_: Round) -> Drafts:
        """Draft for the draft-model rows whose k is positive; every such row
        already in the draft cache takes part, so rows not drafting this round
        still catch up on their pending tokens in the first forward (resuming
        later needs no new prefill); their draft steps are discarded and do
        not consume their RNG."""
        ks = round_.model_ks
        members = [i for i in round_.rows(self.method) if ks[i] or round_.seqs[i] in self.rows]
        seqs = [round_.seqs[i] for i in members]
        new = self.rows.follow(seqs)
        if new:
            last = {s: t for s, t in zip(round_.seqs, round_.last_tokens)}
            self._admit(new, [last[s] for s in new])
        self.rows.order(seqs)
        rows = [self.rows.state[s] for s in seqs]
        # a round feeds a row one or two pending tokens, three after a plain step
        # in between (as a controller's try interleaves them); more is a backlog
        self.caught_up = bool(new) or max(len(r.pending) for r in rows) > 3
        k = max(ks[i] for i in members)
        drafting = [ks[i] > 0 for i in members]
        params = [s.params if d else GREEDY for s, d in zip(seqs, drafting)]
        keys = [s.key for s in seqs]
        drafts, probs = [], []
        grammars = GrammarWalk([s.constraint if d else None for s, d in zip(seqs, drafting)])
        with dispatch.forwards():  # the draft's steps (its prefill, ``_admit``, is built whole)
            logits = self._forward([r.pending for r in rows])
            for step in range(k):
                # q is what the draft samples from: with the target's logit_bias and grammar, its
                # proposals are accepted more often (the verifier masks p with the same grammar state)
                biased = adjust_logits(logits[:, None, :], params, [()] * len(params), [()] * len(params))
                token, keys, logprobs = sample_rows(grammars.mask(biased)[:, 0], params, keys)
                grammars.follow(token)
                drafts.append(token)
                if logprobs is not None:
                    probs.append(mx.exp(logprobs))
                if step < k - 1:
                    logits = self.rows.cache.forward(self.model, token[:, None], provisional=True)[:, -1]
        grammars.rewind()
        self._drafted = k
        tokens = mx.stack(drafts, axis=1)
        q = mx.stack(probs, axis=1) if probs else None
        mx.eval(tokens, keys, *([] if q is None else [q]))
        tokens = tokens.tolist()
        out = Drafts(shape=(len(members), k))
        sampled = 0  # q holds the sampling rows that drafted, in row order (greedy rows need none)
        for j, (i, seq, row) in enumerate(zip(members, seqs, rows)):
            row.drafting = drafting[j]
            if not row.drafting:
                continue
            row.drafted = tokens[j]
            out.chains[i] = tokens[j][: ks[i]]
            seq.key = keys[j]
            if not seq.params.greedy:
                out.q[i] = q[sampled]
                sampled += 1
        return out

    def commit(self, round_: Round, outcome: Outcome) -> None:
        """Roll each row back to its accepted context and queue what it must see next.

        After k draft steps a row's cache holds pending + d_1..d_{k-1}.  It
        keeps those the row accepted and queues the rest of what it emitted:
        when all k were accepted d_k was never fed, so it goes into pending
        ahead of the target's token (and any tokens a grammar forced).
        Rows that did not draft keep only their caught-up context and queue
        what they emitted.
        """
        if not len(self.rows):
            return
        row_of = {s: i for i, s in enumerate(round_.seqs)}
        k, self._drafted = self._drafted, 0
        rejected = []
        for seq in self.rows.seqs:
            row, i = self.rows.state[seq], row_of[seq]
            if row.drafting:
                # the cache keeps the drafted tokens the row accepted (a grammar's forced tokens may follow them)
                kept = common_prefix(row.drafted[: k - 1], outcome.emitted[i][:-1])
                rejected.append(k - 1 - kept)
                row.pending = outcome.emitted[i][kept:]
                row.drafting = False
                continue
            rejected.append(max(k - 1, 0))
            row.pending = (row.pending if not k else []) + outcome.emitted[i]
        if k:
            self.rows.cache.rollback(rejected)

    def settle(self) -> None:
        if len(self.rows):
            self.rows.cache.settle()



class GrammarWalk:
    """The draft steps' view of constrained rows' grammars: each step's
    logits masked at the state after the row's tokens drafted so far, the
    matchers rewound when drafting ends.  A row whose grammar rejects its
    token (a matcher fault) drafts unconstrained from there: its q is still
    what it sampled from, so the verifier stays lossless."""

    def __init__(self, constraints: list[Constraint | None]):
        self.constraints = list(constraints)
        self.walked: dict[Constraint, int] = {c: 0 for c in constraints if c is not None}

    def mask(self, logits: mx.array) -> mx.array:
        if not any(self.constraints):
            return logits
        return mask_logits(logits, self.constraints, [[] for _ in self.constraints])

    def follow(self, tokens: mx.array) -> None:
        if not any(self.constraints):
            return
        for j, token in enumerate(tokens.tolist()):
            constraint = self.constraints[j]
            if constraint is None:
                continue
            if constraint.step(token):
                self.walked[constraint] += 1
            else:
                self.constraints[j] = None

    def rewind(self) -> None:
        for constraint, n in self.walked.items():
            constraint.rewind(n)
