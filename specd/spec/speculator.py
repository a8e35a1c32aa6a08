"""One speculative round for the running batch: propose, verify, roll back.

The engine forwards ``[last, d_1..d_k]`` for every row (right-padded to the
longest proposal, rows without proposals included) and hands the logits
here.  Proposers only propose; ``verify`` alone decides what is kept.  When
an EAGLE head proposes a branching tree, every row's proposal is laid out as
a tree (``tree.py``) and verified in the same single forward.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.batch import forget, rollback, settle
from ..engine.sampling import transform_logprobs
from ..engine.sequence import Sequence
from ..metrics import Metrics
from .config import NO_SPECULATION, SpeculationConfig
from .controller import AcceptanceHistory, Realised, Row, StaticController, make_controller
from .costs import CostModel
from .draft import DraftModelProposer
from .eagle.head import EagleHead
from .eagle.proposer import EagleProposer
from .ngram import NgramIndex
from .tree import DraftTree, TreeLayout, TreePositions, accept, layout, verifying
from .verify import point_mass, verify


@dataclass
class Proposal:
    drafts: list[list[int]]  # per row, possibly empty (a branching tree row: empty, see ``trees``)
    draft_rows: list[int]  # rows a draft model drafted for (its cache follows their verdicts)
    draft_q: dict[int, mx.array] = field(default_factory=dict)  # sampling draft-model rows: (K_draft, V) q
    tree: TreeLayout | None = None  # set when some row proposes a branching tree
    trees: list[DraftTree] | None = None  # every row's proposal as a tree (chains are linear)
    planned: list[int] = field(default_factory=list)  # the k chosen per row (an n-gram lookup may find fewer)

    @property
    def width(self) -> int:
        """Proposal columns the verify forward adds to each row."""
        if self.tree is not None:
            return self.tree.width - 1
        return max((len(d) for d in self.drafts), default=0)


class Speculator:
    """A model's speculation state: its default (from the DraftPairing), its
    draft model and its controller (from the SpecPolicy), all replaceable
    between steps without disturbing requests in flight."""

    def __init__(self, model_name: str, target: nn.Module, vocab_size: int, metrics: Metrics,
                 default: SpeculationConfig = NO_SPECULATION, draft_model: nn.Module | None = None):
        self.name = model_name
        self.target = target
        self.vocab = vocab_size
        self.metrics = metrics
        self.default = default
        self.draft: DraftModelProposer | None = None
        self.eagle: EagleProposer | None = None
        self.positions: TreePositions | None = None  # installed on the target at the first draft tree
        self._kept_columns: list[list[int]] | None = None  # a tree step's kept columns, per row
        self._caught_up = False  # this step's draft model or EAGLE head caught rows up (a prefill or a backlog)
        self.configure(default, draft_model)
        self.costs = CostModel()
        self.realised: dict[int, Realised] = {}  # measured step seconds by batch bucket and k
        self.history = AcceptanceHistory()
        self._estimated: dict[int, Sequence] = {}  # sequences with an acceptance estimate, by id
        # observed or set every step: skip the label lookups
        self._chosen_k = metrics.spec_chosen_k.labels(model_name)
        self._step_seconds: dict | None = None  # exported from the first goodput step on
        self.controller = StaticController(costs=self.costs, history=self.history)
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
        """Default method, acceptance (overall, and by proposal position over
        recent requests) and the fitted costs, as ``describe`` shows them."""
        ema = self.controller.ema
        rate = self.acceptance_rate
        return {"default": self.default.method,
                "drafter": self.drafter if self.eagle is None else f"eagle-{self.eagle.head.config.version}",
                "acceptanceEMA": None if ema is None else round(ema, 4),
                "acceptanceRate": None if rate is None else round(rate, 4),
                "acceptanceByPosition": [round(r, 4) for r in self.history.by_position()],
                "costModelSeconds": {k: round(v, 6) for k, v in self.costs.snapshot().items()},
                "measuredStepMs": self.controller.measured_steps()}

    def configure(self, default: SpeculationConfig, draft_model: nn.Module | None) -> None:
        """Attach, change or detach the pairing (``draft_model``: a draft
        model or an EAGLE head); a new drafter starts with no rows."""
        self.default = default
        head = draft_model if isinstance(draft_model, EagleHead) else None
        if self.eagle is not None and self.eagle.head is not head:
            self.eagle.detach()
            self.eagle = None
        if head is not None and self.eagle is None:
            self.eagle = EagleProposer(head, self.target)
        model = None if head is not None else draft_model
        if model is None:
            self.draft = None
        elif self.draft is None or self.draft.model is not model:
            self.draft = DraftModelProposer(model)

    @property
    def drafter_module(self) -> nn.Module | None:
        """The attached draft model or EAGLE head (to keep when only the pairing's settings change)."""
        return self.eagle.head if self.eagle is not None else self.draft.model if self.draft is not None else None

    @property
    def drafter(self) -> str | None:
        """The method of the attached drafter: "draft", "eagle" or None."""
        return "eagle" if self.eagle is not None else "draft" if self.draft is not None else None

    def set_policy(self, policy, name: str | None) -> None:
        """A new controller for the policy; the learned costs, measured rates and acceptance carry over."""
        self.controller = make_controller(policy, name, self.costs, self.realised, self.history)

    def spec_for(self, seq: Sequence) -> SpeculationConfig:
        return seq.request.speculation or self.default

    def budget(self, seq: Sequence, spec: SpeculationConfig, max_context: int) -> int:
        """The most a request may propose this round: its k, shrunk so the
        round can pass neither the context window nor max_tokens."""
        if not spec.enabled or (spec.method == "draft" and self.draft is None):
            return 0
        if spec.method == "eagle" and (self.eagle is None or not self.eagle.tracks(seq)):
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
                self._estimated[id(s)] = s
            rows.append(Row(budget, spec.method in ("draft", "eagle"), s.estimate))
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
            return Proposal(drafts, [])
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
        draft_q: dict[int, mx.array] = {}
        if rows:
            started = time.perf_counter()
            # every draft-model sequence already in the draft cache takes part, drafting or not
            known = self.draft.known
            members = [i for i, s in enumerate(seqs) if specs[i].method == "draft" and (ks[i] or id(s) in known)]
            k = max(ks[i] for i in rows)
            proposal = self.draft.propose([seqs[i] for i in members], [last_tokens[i] for i in members],
                                          [ks[i] > 0 for i in members], k, [seqs[i].params for i in members],
                                          [seqs[i].key for i in members])
            mx.eval(proposal.drafts, proposal.keys, *([] if proposal.probs is None else [proposal.probs]))
            self._caught_up = self.draft.caught_up
            if not self._caught_up:  # a lazy prefill or a backlog would distort the step cost
                self.costs.observe_draft(len(members), k, time.perf_counter() - started)
            tokens = proposal.drafts.tolist()
            for j, i in enumerate(members):
                if ks[i]:
                    drafts[i] = tokens[j][: ks[i]]
                    seqs[i].key = proposal.keys[j]
            sampled = [i for i in members if ks[i] and not seqs[i].params.greedy]  # the rows of proposal.probs
            draft_q = {i: proposal.probs[n] for n, i in enumerate(sampled)}
            self.metrics.spec_propose_seconds.labels(self.name, "draft").observe(time.perf_counter() - started)
        trees = self._propose_eagle(seqs, specs, ks, drafts)
        for s, spec, k in zip(seqs, specs, ks):
            if k:
                s.stats.method = spec.method
        if trees is None:
            return Proposal(drafts, rows, draft_q, planned=ks)
        trees = [t if t is not None else DraftTree.chain(d) for t, d in zip(trees, drafts)]
        return Proposal(drafts, rows, draft_q, layout(trees, last_tokens), trees, planned=ks)

    def _propose_eagle(self, seqs: list[Sequence], specs: list[SpeculationConfig], ks: list[int],
                       drafts: list[list[int]]) -> list[DraftTree | None] | None:
        """EAGLE rows' proposals: chains go into ``drafts``; branching trees
        are returned (None where a row has none; None at all without any)."""
        if self.eagle is None:
            return None
        members = [i for i, s in enumerate(seqs) if specs[i].method == "eagle" and (ks[i] or self.eagle.admitted(s))]
        if not any(ks[i] for i in members):
            return None
        started = time.perf_counter()
        depth = max(ks[i] for i in members)
        top_k = max(specs[i].tree_top_k for i in members)
        budget = max(specs[i].tree_tokens for i in members) if top_k > 1 else depth
        proposed = self.eagle.propose([seqs[i] for i in members], [ks[i] > 0 for i in members], depth, top_k, budget)
        self._caught_up = self.eagle.caught_up
        trees: list[DraftTree | None] = [None] * len(seqs)
        for i, tree in zip(members, proposed):
            if tree is None:
                continue
            tree = tree.pruned(ks[i])
            if all(p == j - 1 for j, p in enumerate(tree.parents)):
                drafts[i] = tree.tokens
            else:
                trees[i] = tree
        self.metrics.spec_propose_seconds.labels(self.name, "eagle").observe(time.perf_counter() - started)
        if all(t is None for t in trees):
            return None
        if self.positions is None:
            self.positions = TreePositions(self.target)
        return trees

    def forward_context(self, proposal: Proposal, cache: list):
        """Around the verify forward: a tree layout's positions and mask, else nothing."""
        if proposal.tree is None:
            return nullcontext()
        return verifying(self.positions, cache, proposal.tree)

    def verify(self, seqs: list[Sequence], logits: mx.array, proposal: Proposal,
               cache: list) -> tuple[list[list[int]], mx.array]:
        """Keep each row's accepted proposals plus one target token; roll the
        target (and draft) caches back to exactly that.  Returns the tokens
        and, per row, the logits that produced each of them."""
        if proposal.tree is not None:
            return self._verify_tree(seqs, logits, proposal, cache)
        started = time.perf_counter()
        width = proposal.width
        padded = mx.array([d + [0] * (width - len(d)) for d in proposal.drafts])
        sampling = [i for i, s in enumerate(seqs) if not s.params.greedy]
        q = uniforms = gumbel = None
        if sampling:  # only sampling rows need q and randomness
            q = mx.stack([self._chain_q(proposal.draft_q[i], width) if i in proposal.draft_q
                          else point_mass(padded[i], self.vocab) for i in sampling])
            uniforms, gumbel = self._randomness([seqs[i] for i in sampling], width)
        verdict = verify(logits, padded, [len(d) for d in proposal.drafts], [s.params for s in seqs],
                         q, uniforms, gumbel)
        self.metrics.spec_verify_seconds.labels(self.name).observe(time.perf_counter() - started)

        started = time.perf_counter()
        rollback(cache, [width - a for a in verdict.accepted])
        self._settle(seqs, cache, proposal, [len(d) for d in proposal.drafts], verdict.accepted, verdict.next_tokens)
        self.metrics.spec_rollback_seconds.labels(self.name).observe(time.perf_counter() - started)
        return [d[:a] + [t] for d, a, t in zip(proposal.drafts, verdict.accepted, verdict.next_tokens)], logits

    @staticmethod
    def _chain_q(q: mx.array, width: int) -> mx.array:
        """A draft model's (K_draft, V) q cut or zero-padded to ``width`` proposal columns."""
        drafted = q.shape[0]
        return mx.pad(q, [(0, width - drafted), (0, 0)]) if drafted < width else q[:width]

    def _verify_tree(self, seqs: list[Sequence], logits: mx.array, proposal: Proposal,
                     cache: list) -> tuple[list[list[int]], mx.array]:
        """The tree path: walk every row's tree, keep the accepted path's columns."""
        started = time.perf_counter()
        tree, trees = proposal.tree, proposal.trees
        params = [s.params for s in seqs]
        target = transform_logprobs(logits, params)
        uniforms, gumbel = self._randomness(seqs, tree.width)
        verdict = accept(target, trees, tree, [p.greedy for p in params], uniforms, gumbel, proposal.draft_q)
        self.metrics.spec_verify_seconds.labels(self.name).observe(time.perf_counter() - started)

        started = time.perf_counter()
        kept = [[0] + [tree.columns[b][n] for n in path] for b, path in enumerate(verdict.paths)]
        drop = np.ones((len(seqs), tree.width), dtype=bool)
        for b, cols in enumerate(kept):
            drop[b, cols] = False
        forget(cache, drop)
        self._kept_columns = kept
        depths = [max(t.depths(), default=0) for t in trees]
        self._settle(seqs, cache, proposal, depths, [len(p) for p in verdict.paths], verdict.next_tokens)
        self.metrics.spec_rollback_seconds.labels(self.name).observe(time.perf_counter() - started)
        emitted = [[t.tokens[n] for n in path] + [nxt] for t, path, nxt in zip(trees, verdict.paths, verdict.next_tokens)]
        width = max(len(c) for c in kept)
        columns = mx.array([c + [0] * (width - len(c)) for c in kept])
        return emitted, mx.take_along_axis(logits, columns[..., None], axis=1)

    def nothing_proposed(self, seqs: list[Sequence], proposal: Proposal) -> None:
        """A step planned to speculate whose lookups all came back empty: the
        requests' estimates learn what choosing k yielded."""
        if any(proposal.planned):
            none = [0] * len(seqs)
            self.controller.observe([s.estimate for s in seqs], none, none, proposal.planned)

    def _settle(self, seqs: list[Sequence], cache: list, proposal: Proposal, proposed: list[int],
                accepted: list[int], next_tokens: list[int]) -> None:
        """After a verdict and the target's rollback: the draft model's
        rollback, both evaluated now so this step pays for them, then
        statistics and the controller's estimates (a tree counts as a
        proposal as long as its deepest branch)."""
        if proposal.draft_rows:
            rows = proposal.draft_rows
            self.draft.commit([accepted[i] for i in rows], [proposal.drafts[i] for i in rows],
                              [next_tokens[i] for i in rows])
        settle(cache + (self.draft.cache if self.draft is not None else []))
        for s, k, a in zip(seqs, proposed, accepted):
            if k:
                self._count(s, k, a)
        self.drafted_total += sum(proposed)
        self.accepted_total += sum(accepted)
        self.controller.observe([s.estimate for s in seqs], proposed, accepted, proposal.planned)
        if self.controller.ema is not None:
            self.metrics.spec_acceptance_ema.labels(self.name).set(self.controller.ema)

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
            if self._step_seconds is None:
                self._step_seconds = {kind: self.metrics.spec_step_seconds.labels(self.name, kind)
                                      for kind in ("measured", "modelled")}
            self._step_seconds["measured"].set(seconds)
            self._step_seconds["modelled"].set(self.costs.target_seconds(rows, width))
        self.costs.observe_target(rows, width, seconds)

    def observe_outcome(self, rows: int, seconds: float) -> None:
        """A whole decode step's wall time, proposing to emitting: what the controller's bet cost."""
        caught_up, self._caught_up = self._caught_up, False
        self.controller.observe_step(rows, seconds, caught_up)

    def observe_emitted(self, seqs: list[Sequence], emitted: list[list[int]]) -> None:
        """After a decode step: queue what non-drafting rows emitted, so the
        draft cache catches up lazily instead of being prefilled again when
        they resume drafting; hand an EAGLE head the target's features of the
        columns each row kept (a chain's first ones, a tree's path)."""
        if self.draft is not None and self.draft.rows:
            self.draft.observe({id(s): e for s, e in zip(seqs, emitted)})
        kept, self._kept_columns = self._kept_columns, None
        if self.eagle is not None:
            kept = kept or [list(range(len(e))) for e in emitted]
            self.eagle.observe(seqs, [c if self.eagle.tracks(s) else None for s, c in zip(seqs, kept)])

    def observe_prefill(self, seqs: list[Sequence], start: int, end: int, padding: list[int]) -> None:
        """A prefill chunk ran prompt columns [start, end) of left-padded rows:
        an EAGLE head gets the features of each EAGLE sequence's real ones."""
        if self.eagle is None:
            return
        if start == 0:
            self.eagle.track([s for s in seqs if self.spec_for(s).method == "eagle"])
        self.eagle.observe(seqs, [list(range(max(0, pad - start), end - start)) if self.eagle.tracks(s) else None
                                  for s, pad in zip(seqs, padding)])

    def retain(self, seqs: list[Sequence]) -> None:
        """Forget proposer state of sequences that left the batch; their
        acceptance joins the model's history."""
        alive = {id(s) for s in seqs}
        for key in [key for key in self._estimated if key not in alive]:
            self.history.absorb(self._estimated.pop(key).estimate)
        if self.draft is not None:
            self.draft.retain(alive)
        if self.eagle is not None:
            self.eagle.retain(alive)
