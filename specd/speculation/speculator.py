"""Speculation for a model's running batch: what each row may propose.

The engine's scheduler asks the speculator, when it plans a step, how many
tokens each row proposes (``plan``: each row's speculation, shrunk to its
budget, then the controller's k); the model runner asks it for the proposals
(``propose``: every attached proposer drafts for its rows, grammar-forced
tokens end a constrained row's chain, branching trees are laid out), verifies
them (``verifier.py``), rolls the target's cache back, and hands the outcome
back (``commit``: every drafter brings its own state to each row's accepted
context) and to ``feedback`` (``feedback.py``: statistics, acceptance
estimates, step costs and the controller). So a new drafter is a
``Proposer``; the step itself is the runner's. Per-sequence speculation state
(acceptance estimates, proposer rows) lives in the feedback and in the
proposers, released when the engine says a sequence left.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, ContextManager

import mlx.core as mx
import mlx.nn as nn

from ..core.cache import RowCache, make_row_cache
from ..core.layout import clock
from ..core.prefix import PrefixStore, RowPrefixes, model_prefixes
from ..core.sequence import Sequence
from ..metrics import Metrics
from ..core.request import DRAFTERS, NO_SPECULATION, Method, SpeculationConfig
from .controller import Row, proposes_lookup
from .dflash.drafter import DFlashDrafter
from .dflash.proposer import DFlashProposer
from .draft import DraftModelProposer
from .eagle.head import EagleHead
from .eagle.proposer import EagleProposer
from .mtp.head import MTPHead
from .mtp.proposer import MTPProposer
from .feedback import Feedback
from .ngram import NgramProposer
from .proposer import Drafts, Outcome, Proposal, Proposer, Round
from .tree import DraftTree, TreePositions, layout, verifying

# the drafters that read the target's features, and their proposers
FEATURE_DRAFTERS = ((EagleHead, EagleProposer), (MTPHead, MTPProposer), (DFlashDrafter, DFlashProposer))


class Speculator:
    """A model's speculation: its default (from the DraftPairing), its
    proposers and its controller (from the SpecPolicy), all replaceable
    between steps without disturbing requests in flight."""

    def __init__(self, model_name: str, target: nn.Module, vocab_size: int, max_context: int, metrics: Metrics,
                 prefix_store: PrefixStore, default: SpeculationConfig = NO_SPECULATION,
                 drafter: nn.Module | None = None):
        self.name = model_name
        self.prefix_store = prefix_store  # the drafter's tree lives beside the target's
        self.target = target
        self.vocab = vocab_size
        self.max_context = max_context
        self.metrics = metrics
        self.default = default
        self.ngram = NgramProposer()
        self.drafter: DraftModelProposer | EagleProposer | None = None
        self.positions: TreePositions | None = None  # installed on the target at the first draft tree
        # recurrent state cannot keep one branch of a tree: EAGLE drafts chains for such targets
        self.chains_only = make_row_cache(target, [0]).chains_only
        self.feedback = Feedback(model_name, metrics)
        self.configure(default, drafter)
        self._chosen_k = metrics.spec_chosen_k.labels(model_name)  # observed every step: skip the label lookup
        # Under tensor parallelism every rank must speculate alike: the group
        # replaces each rank's choices made from timed costs (k, the width of
        # forced tokens) with rank 0's, since each rank times its own steps.
        self.agree: Callable[[list[int]], list[int]] | None = None

    # -- configuration, from the control plane (between steps) ---------------

    def configure(self, default: SpeculationConfig, drafter: nn.Module | None) -> None:
        """Attach, change or detach the pairing (``drafter``: a draft model, or an EAGLE head,
        an MTP head or a DFlash drafter, which read the target's features); a new drafter starts
        with no rows."""
        self.default = default
        if drafter is self.drafter_module:
            return
        if isinstance(self.drafter, EagleProposer):
            self.drafter.detach()
        store = self.prefix_store
        store.drop("drafter")  # what the old drafter cached
        proposer = next((p for kind, p in FEATURE_DRAFTERS if isinstance(drafter, kind)), None)
        if drafter is None:
            self.drafter = None
        elif proposer is not None:
            tree = store.tree("drafter", stateful=False) if store.enabled else None
            self.drafter = proposer(drafter, self.target, RowPrefixes(tree, [None] * drafter.cache_layers))
        else:
            self.drafter = DraftModelProposer(drafter, model_prefixes(drafter, store, "drafter"))
        self.feedback.costs.block_drafts = isinstance(self.drafter, DFlashProposer)
        self.feedback.use_drafter(drafter)

    def drafter_row_bytes(self) -> tuple[int, int]:
        """What one row of the drafter's cache holds: (bytes per token, recurrent state bytes)."""
        return self.drafter.row_bytes if self.drafter is not None else (0, 0)

    def allow_padding(self, columns: int) -> None:
        """Columns of padding the KV budget has room for beyond the drafter's rows' own."""
        if self.drafter is not None and self.drafter.rows.cache is not None:
            self.drafter.rows.cache.allow_padding(columns)

    def drafter_cache_bytes(self) -> int:
        """Bytes the drafter's rows hold now."""
        cache = self.drafter.rows.cache if self.drafter is not None else None
        return cache.nbytes if cache is not None else 0

    @property
    def drafter_module(self) -> nn.Module | None:
        """The attached draft model or feature-reading drafter (kept when only the pairing's settings change)."""
        if isinstance(self.drafter, EagleProposer):
            return self.drafter.head
        return self.drafter.model if self.drafter is not None else None

    @property
    def drafter_method(self) -> Method | None:
        return self.drafter.method if self.drafter is not None else None

    def take_features(self) -> mx.array | None:
        """The target features of the forward just built, for a drafter that reads them (an EAGLE,
        MTP or DFlash drafter): a plain step takes its own before the next one is built ahead."""
        return self.drafter.take_features() if isinstance(self.drafter, EagleProposer) else None

    def status(self) -> dict:
        """Default method, acceptance (overall, and by proposal position over
        recent requests) and the fitted costs, as ``describe`` shows them."""
        feedback = self.feedback
        ema = feedback.controller.ema
        rate = feedback.acceptance_rate
        drafter = self.drafter_method
        if isinstance(self.drafter, EagleProposer) and isinstance(self.drafter.head, EagleHead):
            drafter = f"eagle-{self.drafter.head.config.version}"
        return {"default": self.default.method,
                "drafter": drafter,
                # a tree asked of a target with recurrent state is drafted as a chain
                "draftTrees": not self.chains_only,
                "acceptanceEMA": None if ema is None else round(ema, 4),
                "acceptanceRate": None if rate is None else round(rate, 4),
                "acceptanceByPosition": [round(r, 4) for r in feedback.history.by_position()],
                "costModelSeconds": {k: round(v, 6) for k, v in feedback.costs.snapshot().items()},
                "measuredStepMs": feedback.controller.measured_steps()}

    # -- the engine's calls ----------------------------------------------------

    def spec_for(self, seq: Sequence) -> SpeculationConfig:
        spec = seq.request.speculation or self.default
        # a grammar checks chains; recurrent state cannot keep one branch of a tree; an MTP head drafts chains
        chains = self.chains_only or seq.constraint is not None or spec.method == Method.MTP
        if chains and spec.tree_top_k > 1:
            spec = replace(spec, tree_top_k=1)
        if isinstance(self.drafter, DFlashProposer) and spec.method == Method.DFLASH:
            most = self.drafter.head.block_size - 1  # a block's first position is the last token
            if spec.num_speculative_tokens > most:
                spec = replace(spec, num_speculative_tokens=most)
        return spec

    def prefilled(self, seqs: list[Sequence], start: int, end: int, padding: list[int], first: bool) -> None:
        """A prefill chunk ran prompt columns [start, end) of left-padded rows
        (``first``: the group's first chunk; rows may start from cached
        prefixes): a drafter that reads the target's features gets each
        row's real ones."""
        if self.drafter is not None:
            columns = [list(range(max(0, pad - start), end - start)) for pad in padding]
            self.drafter.prefilled(seqs, [self.spec_for(s) for s in seqs], columns, first)

    def prefix_limit(self, seq: Sequence) -> int:
        """The longest cached prefix ``seq`` may start from: all its prefill
        runs over (the decode step feeds its last token), but an EAGLE head
        needs the target's features of every position it has no cached
        entry for, so the target runs those again."""
        limit = len(seq.prefill_tokens)
        if isinstance(self.drafter, EagleProposer) and self.spec_for(seq).method == self.drafter.method:
            limit = min(limit, self.drafter.cached(seq.prefill_keys))
        return limit

    def release(self, seqs: list[Sequence]) -> None:
        """Sequences that left the batch: their acceptance joins the model's history."""
        self.feedback.release(seqs)
        for proposer in self._proposers():
            proposer.release(seqs)

    def verify_context(self, cache: RowCache, proposal: Proposal) -> ContextManager:
        """The context the verify forward runs in: a draft tree's ancestry and depth positions."""
        if proposal.tree is None:
            return nullcontext()
        return verifying(self.positions, cache, proposal.tree)

    # -- planning (the scheduler's) and proposing (the runner's) --------------

    def plan(self, seqs: list[Sequence], last_tokens: list[int]) -> Round:
        """How many tokens each row proposes this step: its speculation (its request's, else the
        model's), shrunk to its budget, then the controller's k."""
        specs = [self.spec_for(s) for s in seqs]
        for s, spec in zip(seqs, specs):
            if spec.enabled:
                s.stats.method = spec.method
                s.stats.source = "model" if s.request.speculation is None else "request"
        budgets = [self._budget(s, spec) for s, spec in zip(seqs, specs)]
        if not any(budgets):  # nobody may speculate: keep the plain decode path free of controller work
            return Round(seqs, last_tokens, specs, [0] * len(seqs))
        return self._plan(seqs, last_tokens, specs, budgets)

    def decodes_plainly(self, seqs: list[Sequence]) -> bool:
        """Whether the next step's plan for these rows proposes nothing, whatever their estimates:
        no row may speculate, or the controller will choose plain decoding for the batch."""
        if not any(self.spec_for(s).enabled for s in seqs):
            return True
        return self.feedback.controller.plain_next(len(seqs))

    def propose(self, round_: Round) -> Proposal:
        """The round's proposals: its proposers' drafts for the k planned per row, grammar-forced
        tokens at their ends, and, when a row proposes a branching tree, every row laid out as a tree."""
        seqs = round_.seqs
        offered, caught_up, backlog = self._collect(round_) if any(round_.ks) else (Drafts(), False, 0.0)
        drafts = [offered.chains.get(i, []) for i in range(len(seqs))]
        forced = cut = None
        if any(s.constraint for s in seqs):
            forced, cut = self._jump_forward(seqs, drafts, offered)
        if not offered.trees:
            return Proposal(round_, drafts, offered, caught_up, backlog, forced=forced, cut=cut)
        if self.positions is None:
            self.positions = TreePositions(self.target)
        trees = [offered.trees.get(i) or DraftTree.chain(d) for i, d in enumerate(drafts)]
        return Proposal(round_, drafts, offered, caught_up, backlog, layout(trees, round_.last_tokens), trees, forced,
                        cut)

    def _proposers(self) -> list[Proposer]:
        return [self.ngram] if self.drafter is None else [self.ngram, self.drafter]

    def _budget(self, seq: Sequence, spec: SpeculationConfig) -> int:
        """The most a request may propose this round: its k, shrunk so the
        round can pass neither the context window nor max_tokens."""
        if not spec.enabled:
            return 0
        if spec.method != Method.NGRAM and (self.drafter_method != spec.method or not self.drafter.can_draft(seq)):
            return 0
        room_context = self.max_context - seq.context_length - 1
        room_tokens = seq.request.max_tokens - len(seq.tokens) - 1
        return max(0, min(spec.num_speculative_tokens, room_context, room_tokens))

    def _plan(self, seqs: list[Sequence], last_tokens: list[int], specs: list[SpeculationConfig],
              budgets: list[int]) -> Round:
        """The controller's choice of k for each row, within its budget, and the
        draft-model rows that propose their prompt lookup instead (``proposes_lookup``: a
        lookup costs the device nothing where the draft model does not run at all)."""
        rows, found = [], {}
        for i, (s, spec, budget) in enumerate(zip(seqs, specs, budgets)):
            estimate = self.feedback.estimate(s)
            if budget and spec.method == Method.DRAFT:
                found[i] = self.ngram.lookup(s, spec, budget)
            seeded = s.params.seed is not None and not s.params.greedy
            rows.append(Row(budget, spec.method in DRAFTERS, estimate, len(found.get(i, ())), seeded))
        ks, reason = self.feedback.controller.plan(rows, len(seqs))
        if self.agree is not None:
            ks = self.agree(ks)
        for k in ks:
            self._chosen_k.observe(k)
        if reason is not None:
            self.metrics.spec_off_steps.labels(self.name, reason).inc(sum(1 for r in rows if r.budget))
        lookups = {i: found[i][:ks[i]] for i, lookup in enumerate(proposes_lookup(rows, ks)) if lookup}
        return Round(seqs, last_tokens, specs, ks, lookups)

    def _jump_forward(self, seqs: list[Sequence], drafts: list[list[int]],
                      offered: Drafts) -> tuple[list[int], list[int]]:
        """Check each constrained row's chain against its grammar and end it
        with what the grammar forces there (SGLang's jump-forward): a forced
        token costs a column of this forward, not a round of its own.
        Returns the forced tokens per row, and the proposed ones cut."""
        forced, cut = [0] * len(seqs), [0] * len(seqs)
        for i, seq in enumerate(seqs):
            if seq.constraint is not None:
                room = min(self.max_context - seq.context_length, seq.request.max_tokens - len(seq.tokens)) - 1
                proposed = len(drafts[i])
                drafts[i], forced[i] = seq.constraint.extend(drafts[i], room, i in offered.q)
                cut[i] = proposed - (len(drafts[i]) - forced[i])
        if not any(forced):  # no forced column to weigh: every chain stays as proposed
            return forced, cut
        width = self._forced_width(drafts, forced)
        if self.agree is not None:
            width = self.agree([width])[0]
        for i, chain in enumerate(drafts):
            if len(chain) > width:
                forced[i] -= len(chain) - width
                drafts[i] = chain[:width]
        return forced, cut

    def _forced_width(self, drafts: list[list[int]], forced: list[int]) -> int:
        """How many proposal columns the forced tokens are worth: every row
        pays for the batch's widest proposal, so one row's long run of forced
        tokens can cost the batch more than it gains.  The width (never
        shorter than the proposers' own chains) that the cost model says
        yields the most tokens per second, forced tokens counted as accepted."""
        rows = len(drafts)
        drafted = [len(d) - f for d, f in zip(drafts, forced)]
        floor = max(drafted)
        ema = self.feedback.controller.ema
        acceptance = ema if ema is not None else 0.5
        base = rows + acceptance * sum(drafted)  # each row's next token, and what its drafts may yield

        def rate(width: int) -> float:
            gained = sum(max(0, min(len(d), width) - n) for d, n in zip(drafts, drafted))
            return (base + gained) / self.feedback.costs.target_seconds(rows, width + 1)
        return max(sorted({floor, *(len(d) for d in drafts if len(d) > floor)}), key=rate)

    def _collect(self, round_: Round) -> tuple[Drafts, bool, float]:
        """Every attached proposer's drafts for its rows, whether one caught rows up, and the
        seconds they fed backlogs apart."""
        offered, caught_up, backlog = Drafts(chains=dict(round_.lookups)), False, 0.0
        ks = round_.model_ks
        for proposer in self._proposers():
            if not any(ks[i] for i in round_.rows(proposer.method)):
                continue
            started = clock()
            drafts = proposer.propose(round_)
            seconds = clock() - started - proposer.backlog_seconds
            caught_up |= proposer.caught_up
            backlog += proposer.backlog_seconds
            offered.chains.update(drafts.chains)
            offered.q.update(drafts.q)
            offered.trees.update(drafts.trees)
            if drafts.shape is not None and not proposer.caught_up:  # a prefill or a backlog would distort it
                self.feedback.costs.observe_draft(*drafts.shape, seconds)
            self.metrics.spec_propose_seconds.labels(self.name, proposer.method).observe(seconds)
        return offered, caught_up, backlog

    # -- after the verdict -------------------------------------------------------

    def commit(self, proposal: Proposal, outcome: Outcome) -> None:
        """Every drafter brings its state to each row's accepted context;
        before the target's rollback, which may run the target again (to
        re-advance recurrent state), so an EAGLE head still reads the
        features of the verify forward."""
        if self.drafter is not None:
            self.drafter.commit(proposal.round, outcome)

    def settle(self) -> None:
        """Evaluate what the drafters' commit left lazy, so the step that verified pays for it."""
        if self.drafter is not None:
            self.drafter.settle()
