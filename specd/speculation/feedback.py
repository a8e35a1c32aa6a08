"""What speculation rounds teach, and who learns from it.

After a step's verdict the runner hands its proposals and what each row
accepted here (``count``), then the step's seconds (``observe_step``).  They
feed the requests' statistics and the Prometheus metrics, each request's
acceptance estimate (pooled into the model's history when it leaves), the cost
model and the controller, which reads all of these when the speculator plans
the next round.  The controller is replaced when the SpecPolicy changes; what
was learned carries over.  What a drafter's rounds taught (its acceptance, what
its draft steps cost, whole steps' seconds at each k: ``DrafterLearning``) is
that drafter's own: a draft model's cheap steps or high acceptance must not
speak for an MTP head attached after it, nor the head's for the draft model
attached again (what was learned with it comes back). What the target's
forwards cost is the target's, and stays.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from ..core.request import Method
from ..core.sequence import Sequence
from ..metrics import Metrics
from .acceptance import AcceptanceEstimate, AcceptanceHistory
from .config import PolicySettings
from .controller import StaticController, make_controller
from .costs import CostModel, DraftStepFit
from .exploration import Realised
from .proposer import Outcome, Proposal


@dataclass
class DrafterLearning:
    """What rounds proposed with one drafter (or with n-gram lookups alone) taught."""

    history: AcceptanceHistory = field(default_factory=AcceptanceHistory)
    draft: DraftStepFit = field(default_factory=DraftStepFit)  # what its draft steps cost
    realised: dict[int, Realised] = field(default_factory=dict)  # whole steps' seconds by batch bucket and k


class Feedback:
    """A model's learning from its speculation rounds: statistics, acceptance estimates and
    history, step costs, and the controller that chooses k from them."""

    def __init__(self, model_name: str, metrics: Metrics):
        self.name = model_name
        self.metrics = metrics
        self.costs = CostModel()
        self.learning = DrafterLearning(draft=self.costs.draft)  # the attached drafter's
        # the drafters attached before, by a weak reference (a drafter replaced is freed), and what they taught
        self._learned: list[tuple[weakref.ref | None, DrafterLearning]] = [(None, self.learning)]
        self.estimates: dict[Sequence, AcceptanceEstimate] = {}
        self.controller = StaticController(costs=self.costs, history=self.history)
        self.drafted_total = 0
        self.accepted_total = 0
        self._step_seconds: dict | None = None  # exported from the first goodput step on

    @property
    def history(self) -> AcceptanceHistory:
        """The attached drafter's acceptance across requests."""
        return self.learning.history

    @property
    def realised(self) -> dict[int, Realised]:
        """The attached drafter's measured step seconds by batch bucket and k."""
        return self.learning.realised

    def set_policy(self, policy: PolicySettings | None, name: str | None) -> None:
        """A new controller for the policy; the learned costs, measured rates and acceptance carry over."""
        self.controller = make_controller(policy, name, self.costs, self.realised, self.history)

    def use_drafter(self, drafter: object | None) -> None:
        """A drafter attached (None: n-gram lookups alone), between steps: learn and decide from
        what it taught when it was attached before, else afresh. Requests in flight start new
        estimates from its history: theirs measured another drafter's proposals."""
        self._learned = [(ref, learning) for ref, learning in self._learned if ref is None or ref() is not None]
        learning = next((learning for ref, learning in self._learned
                         if (ref() if ref is not None else None) is drafter), None)
        if learning is None:
            learning = DrafterLearning()
            self._learned.append((None if drafter is None else weakref.ref(drafter), learning))
        if learning is self.learning:
            return
        self.learning = learning
        self.costs.draft = learning.draft
        self.estimates.clear()
        self.set_policy(self.controller.policy, self.controller.policy_name)

    def estimate(self, seq: Sequence) -> AcceptanceEstimate:
        """The request's acceptance estimate, started from the model's history at its first round."""
        estimate = self.estimates.get(seq)
        if estimate is None:
            estimate = self.estimates[seq] = self.controller.new_estimate()
        return estimate

    def release(self, seqs: list[Sequence]) -> None:
        """Sequences that left the batch: their acceptance joins the model's history."""
        for seq in seqs:
            estimate = self.estimates.pop(seq, None)
            if estimate is not None:
                self.history.absorb(estimate)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted over the engine's life (what DraftPairing status shows)."""
        return self.accepted_total / self.drafted_total if self.drafted_total else None

    def count(self, seqs: list[Sequence], proposal: Proposal, outcome: Outcome) -> None:
        """What a round's verdict teaches, before its tokens are handed out (a request's last
        output reports its speculation): each row's proposals and what it accepted (statistics
        and the controller's estimates; a tree counts as a proposal as long as its deepest branch;
        tokens a grammar forced count apart)."""
        if proposal.width == 0:
            self._nothing_proposed(seqs, proposal)
            for seq in seqs:
                seq.stats.plain_steps += 1
        else:
            self._count_round(seqs, proposal, outcome)

    def observe_step(self, rows: int, proposal: Proposal, forward_seconds: float, step_seconds: float,
                     ran_ahead: bool | None = None) -> None:
        """What the step cost: its forward with verification and rollback (the cost model's
        input; under a goodput policy also exported next to what the model predicted) and the
        whole step, its tokens handed out (the controller's); ``ran_ahead``: for a plain step
        whose rows could run ahead of the step before (``runner.py``), whether it did."""
        width = proposal.width + 1
        if self.controller.mode == "goodput":
            if self._step_seconds is None:
                self._step_seconds = {kind: self.metrics.spec_step_seconds.labels(self.name, kind)
                                      for kind in ("measured", "modelled")}
            self._step_seconds["measured"].set(forward_seconds)
            self._step_seconds["modelled"].set(self.costs.target_seconds(rows, width))
        self.costs.observe_target(rows, width, forward_seconds)
        self.controller.observe_step(rows, step_seconds - proposal.backlog_seconds, proposal.caught_up, ran_ahead)

    def _count_round(self, seqs: list[Sequence], proposal: Proposal, outcome: Outcome) -> None:
        verified = proposal.drafted
        accepted = [min(a, n) for a, n in zip(outcome.accepted, verified)]
        if proposal.forced is not None:
            self.metrics.grammar_forced_tokens.labels(self.name).inc(sum(outcome.accepted) - sum(accepted))
        # what a grammar cut counts as proposed and rejected, so acceptance stays honest
        proposed = verified if proposal.cut is None else [n + c for n, c in zip(verified, proposal.cut)]
        lookups = proposal.round.lookups
        for i, (s, k, a) in enumerate(zip(seqs, proposed, accepted)):
            if k:
                self._count(s, k, a, Method.NGRAM if i in lookups else s.stats.method)
            else:
                s.stats.plain_steps += 1
        self.drafted_total += sum(proposed)
        self.accepted_total += sum(accepted)
        if any(proposal.round.ks):  # a round of forced tokens only planned nothing
            self.controller.observe([self.estimates[s] for s in seqs], proposed, accepted, proposal.round.ks)
        if self.controller.ema is not None:
            self.metrics.spec_acceptance_ema.labels(self.name).set(self.controller.ema)

    def _nothing_proposed(self, seqs: list[Sequence], proposal: Proposal) -> None:
        """A step planned to speculate whose lookups all came back empty (or
        whose proposals a grammar cut, counted as rejected): the requests'
        estimates learn what choosing k yielded."""
        if any(proposal.round.ks):
            none = [0] * len(seqs)
            cut = proposal.cut or none
            self.drafted_total += sum(cut)
            self.controller.observe([self.estimates[s] for s in seqs], cut, none, proposal.round.ks)

    def _count(self, seq: Sequence, drafted: int, accepted: int, method: Method) -> None:
        """One round's proposals of a request, in its stats and in the metrics under the
        method that proposed them (a draft pairing's lookups under ``ngram``)."""
        seq.stats.count(drafted, accepted, method)
        m, labels = self.metrics, (self.name, method)
        m.spec_num_drafts.labels(*labels).inc()
        m.spec_num_draft_tokens.labels(*labels).inc(drafted)
        m.spec_num_accepted_tokens.labels(*labels).inc(accepted)
        for pos in range(accepted):
            m.spec_accepted_per_pos.labels(*labels, str(pos)).inc()
