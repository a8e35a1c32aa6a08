"""Speculation controllers: how far each request speculates this step.

``StaticController`` is the seed policy (``mode: static``): an EMA of the
model's acceptance rate, speculation off when the batch reaches
``disableByBatchSize`` or the EMA falls below ``acceptanceRateThreshold``, k
capped by ``maxSpeculativeTokens``; while acceptance keeps speculation off,
every ``probeInterval``-th step still speculates so the EMA can recover.

``GoodputController`` (``mode: goodput``) chooses, every step, the k that
maximises expected tokens per second of wall time for the whole batch, from
each request's own acceptance estimate and from step costs measured online
(``CostModel``).  The verify forward pads every row to the longest proposal,
so the batch shares one width; rows whose expected gain does not pay for
their drafting are left out, and k = 0 when speculating cannot pay at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..api.manifest import SpecPolicySpec
from .costs import CostModel

class StaticController:
    mode = "static"
    PRIOR_WEIGHT = 4.0  # how many positions the model's history counts for a new request

    def __init__(self, policy: SpecPolicySpec | None = None, name: str | None = None,
                 costs: CostModel | None = None):
        self.policy = policy
        self.policy_name = name
        self.costs = costs or CostModel()
        self.ema: float | None = None
        self._steps_off = 0
        self._probe_cursor = -1

    def plan(self, rows: list["Row"], batch_size: int) -> tuple[list[int], str | None]:
        """The k each row may use now (its budget already applied), and why
        speculation is off this step if it is."""
        policy = self.policy
        asked = [r.budget for r in rows]
        if policy is None or not any(asked):
            return asked, None
        if not policy.enabled:
            return [0] * len(rows), "policy_disabled"
        if policy.disable_by_batch_size is not None and batch_size >= policy.disable_by_batch_size:
            return [0] * len(rows), "batch_size"
        if self.ema is not None and self.ema < policy.acceptance_rate_threshold:
            self._steps_off += 1
            if self._steps_off % policy.probe_interval:
                return [0] * len(rows), "low_acceptance"
        return [min(k, policy.max_speculative_tokens) for k in asked], None

    def new_estimate(self) -> "AcceptanceEstimate":
        """A request's starting estimate: the model's recent acceptance, weakly held."""
        prior = self.ema if self.ema is not None else 0.5
        return AcceptanceEstimate(prior * self.PRIOR_WEIGHT, (1 - prior) * self.PRIOR_WEIGHT)

    def observe(self, estimates: list["AcceptanceEstimate"], proposed: list[int], accepted: list[int]) -> None:
        """Fold one step's acceptance into the model's EMA and each request's estimate."""
        drafted = sum(proposed)
        if drafted == 0:
            return
        rate = sum(accepted) / drafted
        alpha = self.policy.ema_alpha if self.policy is not None else 0.1
        self.ema = rate if self.ema is None else (1 - alpha) * self.ema + alpha * rate
        for estimate, k, a in zip(estimates, proposed, accepted):
            if k:
                estimate.update(k, a, alpha)


@dataclass
class AcceptanceEstimate:
    """A request's per-token acceptance probability, as decayed success and
    failure counts over proposal positions (a round accepting a of k is a
    successes and, if a < k, one failure), started from a prior."""

    successes: float
    failures: float

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def update(self, k: int, accepted: int, decay: float) -> None:
        keep = 1.0 - decay
        self.successes = keep * self.successes + accepted
        self.failures = keep * self.failures + (1 if accepted < k else 0)


@dataclass
class Row:
    """What a controller knows about one request this step."""

    budget: int  # the most it may propose (request's k within context/max_tokens)
    drafts_with_model: bool  # its proposals cost draft-model steps
    estimate: AcceptanceEstimate


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round yields with k proposals, each accepted with probability alpha."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class GoodputController(StaticController):
    mode = "goodput"

    def plan(self, rows: list[Row], batch_size: int) -> tuple[list[int], str | None]:
        policy = self.policy
        asked = [r.budget for r in rows]
        if not any(asked):
            return asked, None
        if policy is not None and not policy.enabled:
            return [0] * len(rows), "policy_disabled"
        cap = max(asked) if policy is None else min(max(asked), policy.max_speculative_tokens)
        self._steps_off += 1
        probing = policy is not None and self._steps_off % policy.probe_interval == 0
        best_k, best_rate, best_rows = 0, self._rate(rows, 0, [False] * len(rows)), [False] * len(rows)
        for k in range(1, cap + 1):
            use = self._worth_it(rows, k)
            rate = self._rate(rows, k, use)
            if rate > best_rate * 1.0001:
                best_k, best_rate, best_rows = k, rate, use
        if best_k == 0 and probing:  # one request at a time, so estimates can recover cheaply
            candidates = [i for i, r in enumerate(rows) if r.budget > 0]
            self._probe_cursor += 1
            chosen = candidates[self._probe_cursor % len(candidates)]
            best_k, best_rows = 1, [i == chosen for i in range(len(rows))]
        if best_k == 0:
            return [0] * len(rows), "no_gain"
        self._steps_off = 0
        return [min(best_k, r.budget) if use else 0 for r, use in zip(rows, best_rows)], None

    def _worth_it(self, rows: list[Row], k: int) -> list[bool]:
        """Rows whose expected extra tokens pay for the drafting they add."""
        per_row_draft = self.costs.draft_row_seconds() * k
        tokens_per_second = 1.0 / max(self.costs.target_seconds(len(rows), 1), 1e-6)
        use = []
        for r in rows:
            if r.budget == 0:
                use.append(False)
                continue
            gain = expected_tokens(r.estimate.alpha, min(k, r.budget)) - 1.0
            cost = per_row_draft * tokens_per_second if r.drafts_with_model else 0.0
            use.append(gain > cost)
        return use

    def _rate(self, rows: list[Row], k: int, use: list[bool]) -> float:
        """Expected tokens per second for the batch if ``use`` rows propose up to k."""
        width = 1 + (k if any(use) else 0)
        drafting = sum(1 for r, u in zip(rows, use) if u and r.drafts_with_model)
        seconds = self.costs.target_seconds(len(rows), width) + self.costs.draft_seconds(drafting, k)
        tokens = sum(expected_tokens(r.estimate.alpha, min(k, r.budget)) if u else 1.0
                     for r, u in zip(rows, use))
        return tokens / seconds

def make_controller(policy: SpecPolicySpec | None, name: str | None, costs: CostModel) -> StaticController:
    cls = GoodputController if policy is not None and policy.mode == "goodput" else StaticController
    return cls(policy, name, costs)
