"""One speculative round for the running batch: propose, verify, roll back.

The engine forwards ``[last, d_1..d_k]`` for every row (right-padded to the
longest proposal, rows without proposals included) and hands the logits
here.  Proposers only propose; ``verify`` alone decides what is kept, so new
proposers (EAGLE) slot in without touching the verifier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..engine.batch import rollback
from ..engine.sampling import transform_logprobs
from ..engine.sequence import Sequence
from ..metrics import Metrics
from .config import NO_SPECULATION, SpeculationConfig
from .controller import Row, StaticController, make_controller
from .costs import CostModel
from .draft import DraftModelProposer
from .ngram import NgramIndex
from .verify import point_mass, verify


@dataclass
class Proposal:
    drafts: list[list[int]]  # per row, possibly empty
    draft_probs: mx.array | None  # (len(draft_rows), K_draft, V) q of draft-model rows
    draft_rows: list[int]

    @property
    def width(self) -> int:
        return max((len(d) for d in self.drafts), default=0)


class Speculator:
    """A model's speculation state: its default (from the DraftPairing), its
    draft model and its controller (from the SpecPolicy), all replaceable
    between steps without disturbing requests in flight."""

    def __init__(self, model_name: str, vocab_size: int, metrics: Metrics,
                 default: SpeculationConfig = NO_SPECULATION, draft_model: nn.Module | None = None):
        self.name = model_name
        self.vocab = vocab_size
        self.metrics = metrics
        self.default = default
        self.draft = DraftModelProposer(draft_model) if draft_model is not None else None
        self.costs = CostModel()
        self._chosen_k = metrics.spec_chosen_k.labels(model_name)  # observed per row and step: skip the lookup
        self.controller = StaticController(costs=self.costs)
        self.drafted_total = 0
        self.accepted_total = 0
        # Under tensor parallelism every rank must speculate alike: the group
        # replaces each rank's choice of k with rank 0's (time-driven costs differ).
        self.agree: Callable[[list[int]], list[int]] | None = None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted over the engine's life (what DraftPairing status shows)."""
        return self.accepted_total / self.drafted_total if self.drafted_total else None

    def status(self) -> dict:
        """Default method, acceptance and the fitted costs, as ``describe`` shows them."""
        ema = self.controller.ema
        rate = self.acceptance_rate
        return {"default": self.default.method,
                "acceptanceEMA": None if ema is None else round(ema, 4),
                "acceptanceRate": None if rate is None else round(rate, 4),
                "costModelSeconds": {k: round(v, 6) for k, v in self.costs.snapshot().items()},
                "realisedTokensPerSecond": self.controller.realised_rates()}

    def configure(self, default: SpeculationConfig, draft_model: nn.Module | None) -> None:
        """Attach, change or detach the pairing; a new draft model starts with no rows."""
        self.default = default
        if draft_model is None:
            self.draft = None
        elif self.draft is None or self.draft.model is not draft_model:
            self.draft = DraftModelProposer(draft_model)

    def set_policy(self, policy, name: str | None) -> None:
        """A new controller for the policy; the learned costs carry over."""
        self.controller = make_controller(policy, name, self.costs)

    def spec_for(self, seq: Sequence) -> SpeculationConfig:
        return seq.request.speculation or self.default

    def budget(self, seq: Sequence, spec: SpeculationConfig, max_context: int) -> int:
        """The most a request may propose this round: its k, shrunk so the
        round can pass neither the context window nor max_tokens."""
        if not spec.enabled or (spec.method == "draft" and self.draft is None):
            return 0
        room_context = max_context - seq.context_length - 1
        room_tokens = seq.request.max_tokens - len(seq.tokens) - 1
        return max(0, min(spec.num_speculative_tokens, room_context, room_tokens))

    def _plan(self, seqs: list[Sequence], specs: list[SpeculationConfig], budgets: list[int]) -> list[int]:
        """The controller's choice of k for each row, within its budget."""
        rows = []
        for s, spec, budget in zip(seqs, specs, budgets):
            if s.estimate is None:
                s.estimate = self.controller.new_estimate()
            rows.append(Row(budget, spec.method == "draft", s.estimate))
        ks, reason = self.controller.plan(rows, len(seqs))
        if self.agree is not None:
            ks = self.agree(ks)
        for k in ks:
            self._chosen_k.observe(k)
        if reason is not None:
            self.metrics.spec_off_steps.labels(self.name, reason).inc(sum(1 for r in rows if r.budget))
        return ks

    def propose(self, seqs: list[Sequence], last_tokens: list[int], max_context: int) -> Proposal:
        specs = [self.spec_for(s) for s in seqs]
        budgets = [self.budget(s, spec, max_context) for s, spec in zip(seqs, specs)]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not any(budgets):  # nobody may speculate: keep the plain decode path free of controller work
            return Proposal(drafts, None, [])
        ks = self._plan(seqs, specs, budgets)
        started = time.perf_counter()
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if k and specs[i].method == "ngram":
                if s.ngram is None:
                    s.ngram = NgramIndex(specs[i].ngram_min, specs[i].ngram_max)
                    s.ngram.extend(s.prompt)
                unseen = s.context_length - len(s.ngram.tokens)
                s.ngram.extend(s.tokens[len(s.tokens) - unseen:])
                drafts[i] = s.ngram.propose(k)
        if any(drafts):
            self.metrics.spec_propose_seconds.labels(self.name, "ngram").observe(time.perf_counter() - started)
        rows = [i for i, k in enumerate(ks) if k and specs[i].method == "draft"]
        probs = None
        if rows:
            started = time.perf_counter()
            # every draft-model sequence already in the draft cache takes part, drafting or not
            known = self.draft.known
            members = [i for i, s in enumerate(seqs) if specs[i].method == "draft" and (ks[i] or id(s) in known)]
            k = max(ks[i] for i in rows)
            proposal = self.draft.propose([seqs[i] for i in members], [last_tokens[i] for i in members],
                                          [ks[i] > 0 for i in members], k, [seqs[i].params for i in members],
                                          [seqs[i].key for i in members])
            mx.eval(proposal.drafts, proposal.probs, proposal.keys)
            if self.draft.admitted == 0:  # a lazy prefill would distort the step cost
                self.costs.observe_draft(len(members), k, time.perf_counter() - started)
            tokens = proposal.drafts.tolist()
            picked = []
            for j, i in enumerate(members):
                if ks[i]:
                    drafts[i] = tokens[j][: ks[i]]
                    seqs[i].key = proposal.keys[j]
                    picked.append(j)
            probs = proposal.probs[mx.array(picked)]
            self.metrics.spec_propose_seconds.labels(self.name, "draft").observe(time.perf_counter() - started)
        for s, spec, k in zip(seqs, specs, ks):
            if k:
                s.stats.method = spec.method
        return Proposal(drafts, probs, rows)

    def verify(self, seqs: list[Sequence], logits: mx.array, proposal: Proposal,
               cache: list) -> list[list[int]]:
        """Keep each row's accepted proposals plus one target token; roll the
        target (and draft) caches back to exactly that.  Returns the tokens."""
        started = time.perf_counter()
        width = proposal.width
        params = [s.params for s in seqs]
        target = transform_logprobs(logits, params)
        padded = mx.array([d + [0] * (width - len(d)) for d in proposal.drafts])
        q = point_mass(padded, self.vocab)
        if proposal.draft_rows:
            kd = proposal.draft_probs.shape[1]
            dq = mx.pad(proposal.draft_probs, [(0, 0), (0, width - kd), (0, 0)]) if kd < width \
                else proposal.draft_probs[:, :width]
            q[mx.array(proposal.draft_rows)] = dq
        uniforms, gumbel = self._randomness(seqs, width)
        verdict = verify(target, padded, [len(d) for d in proposal.drafts], q,
                         [p.greedy for p in params], uniforms, gumbel)
        self.metrics.spec_verify_seconds.labels(self.name).observe(time.perf_counter() - started)

        started = time.perf_counter()
        rollback(cache, [width - a for a in verdict.accepted])
        if proposal.draft_rows:
            rows = proposal.draft_rows
            self.draft.commit([verdict.accepted[i] for i in rows], [proposal.drafts[i] for i in rows],
                              [verdict.next_tokens[i] for i in rows])
        self.metrics.spec_rollback_seconds.labels(self.name).observe(time.perf_counter() - started)
        out = []
        for s, d, a, t in zip(seqs, proposal.drafts, verdict.accepted, verdict.next_tokens):
            if d:
                self._count(s, len(d), a)
            out.append(d[:a] + [t])
        proposed = [len(d) for d in proposal.drafts]
        self.drafted_total += sum(proposed)
        self.accepted_total += sum(verdict.accepted)
        self.controller.observe([s.estimate for s in seqs], proposed, verdict.accepted)
        if self.controller.ema is not None:
            self.metrics.spec_acceptance_ema.labels(self.name).set(self.controller.ema)
        return out

    def _randomness(self, seqs: list[Sequence], width: int) -> tuple[mx.array, mx.array]:
        """Acceptance uniforms and final-draw noise from each sampling row's own key."""
        uniforms, gumbel = [], []
        for s in seqs:
            if s.params.greedy:
                uniforms.append(mx.zeros((width,)))
                gumbel.append(mx.zeros((self.vocab,)))
                continue
            s.key, sub = mx.random.split(s.key)
            k_u, k_g = mx.random.split(sub)
            uniforms.append(mx.random.uniform(shape=(width,), key=k_u))
            gumbel.append(mx.random.gumbel(shape=(self.vocab,), key=k_g))
        return mx.stack(uniforms), mx.stack(gumbel)

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        seq.stats.rounds += 1
        seq.stats.drafted += drafted
        seq.stats.accepted += accepted
        m, labels = self.metrics, (self.name, seq.stats.method)
        m.spec_num_drafts.labels(*labels).inc()
        m.spec_num_draft_tokens.labels(*labels).inc(drafted)
        m.spec_num_accepted_tokens.labels(*labels).inc(accepted)
        for pos in range(accepted):
            m.spec_accepted_per_pos.labels(*labels, str(pos)).inc()

    def observe_step(self, rows: int, width: int, seconds: float) -> None:
        """Feed a decode step's wall time to the cost model; under a goodput
        policy also export it next to what the model predicted."""
        if self.controller.mode == "goodput":
            predicted = self.costs.target_seconds(rows, width)
            self.metrics.spec_step_seconds.labels(self.name, "measured").set(seconds)
            self.metrics.spec_step_seconds.labels(self.name, "modelled").set(predicted)
        self.costs.observe_target(rows, width, seconds)

    def observe_outcome(self, rows: int, k: int, tokens: int, seconds: float) -> None:
        """A whole decode step (k: its longest proposal), proposing to emitting:
        what the controller's bets returned."""
        self.controller.observe_step(rows, k, tokens, seconds)

    def observe_emitted(self, seqs: list[Sequence], emitted: list[list[int]]) -> None:
        """Queue what non-drafting rows emitted, so the draft cache catches up
        lazily instead of being prefilled again when they resume drafting."""
        if self.draft is not None and self.draft.rows:
            self.draft.observe({id(s): e for s, e in zip(seqs, emitted)})

    def retain(self, seqs: list[Sequence]) -> None:
        """Forget proposer state of sequences that left the batch."""
        if self.draft is not None:
            self.draft.retain({id(s) for s in seqs})
