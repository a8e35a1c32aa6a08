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

A model of costs misses whatever it does not model (proposal bookkeeping, a
lazy draft prefill, cache effects), so its bets are checked against what
they return: ``Realised`` keeps, per batch-size bucket, the tokens per second
of whole steps (proposing to emitting) that speculated and that did not.
Where speculating measurably loses, the bucket decodes plainly and tries
speculation again (with a shorter k first) after 16, 32 .. steps, spaced so
that the tries cost at most 1% of the decode time, while a workload that
turns repetitive is still noticed.
"""

from __future__ import annotations

import math
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

    def realised_rates(self) -> dict[str, dict[str, float | None]]:
        """Measured tokens/s by batch-size bucket (only the goodput controller measures them)."""
        return {}

    def observe_step(self, batch_size: int, k: int, tokens: int, seconds: float) -> None:
        """A whole decode step's outcome, k its longest proposal (only the goodput controller uses it)."""

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


class Realised:
    """Measured tokens per second of plain and speculative steps in one
    batch-size bucket, and when speculation may be tried again.

    Speculation that is not measured to pay is tried now and then: a try is
    ``TRIAL`` speculative steps, judged on all but its first (which pays for
    catching a draft's cache up, a one-off cost a request amortises over its
    life).  A try that loses sets the next one 16, 32, .. steps away, and never
    sooner than its cost beyond plain steps allows within ``EXPLORE_BUDGET``
    of the decode time.  A losing try with k > 1 halves the k the next try may
    use (the cost model may have bet too far, while a shorter k pays); one
    that loses at k = 1 lifts the cap again for the (much later) next try."""

    ALPHA = 0.2  # EMA weight of one step
    TRIAL = 4  # speculative steps per try
    FIRST_RETRY, LAST_RETRY = 16, 1024  # steps between tries of a losing arm
    EXPLORE_BUDGET = 0.01  # share of the decode time losing tries may cost
    REFRESH = 64  # steps between plain steps taken to keep the baseline current

    def __init__(self) -> None:
        self.plain: float | None = None  # tokens/s
        self.speculative: float | None = None
        self.plain_step: float | None = None  # seconds
        self.retry_every = self.FIRST_RETRY  # spacing after a try lost even at k = 1 (doubles)
        self.wait = self.FIRST_RETRY  # plain steps before the next try
        self.since_speculative = 0
        self.since_plain = 0
        self.tries = 0
        self.trial = 0  # speculative steps left in the current try
        self.trial_extra = 0.0  # what the try cost beyond plain steps (seconds)
        self.trial_k = 0  # the longest proposal the try made
        self.k_cap: int | None = None  # the most k may be, after losing tries

    def decide(self) -> str | None:
        """None: the model may speculate (starting a try when one is due); else why this step is plain."""
        if self.plain is None:
            return "baseline"
        if self.trial:
            return None
        if self.speculative is not None and self.speculative >= self.plain:
            return "baseline" if self.since_plain >= self.REFRESH else None
        if not self.tries or self.since_speculative >= self.wait:
            self.tries += 1
            self.trial, self.trial_extra, self.trial_k = self.TRIAL, 0.0, 0
            return None
        return "no_gain"

    def observe(self, k: int, tokens: int, seconds: float) -> None:
        """One decode step: its longest proposal (0: plain), its tokens and wall time."""
        rate = tokens / seconds
        if not k:
            self.plain = _ema(self.plain, rate, self.ALPHA)
            self.plain_step = _ema(self.plain_step, seconds, self.ALPHA)
            self.since_plain = 0
            self.since_speculative += 1
            if self.trial:  # the cost model declined to go on: the try is over
                self.trial = 0
                self._spacing()
            return
        self.since_speculative = 0
        self.since_plain += 1
        if not self.trial:  # speculating because it pays
            self.speculative = _ema(self.speculative, rate, self.ALPHA)
            return
        self.trial -= 1
        self.trial_extra += seconds - (self.plain_step or seconds)
        self.trial_k = max(self.trial_k, k)
        judged = self.TRIAL - 1 - self.trial  # steps of this try after its first
        if judged == 1:
            self.speculative = rate  # fresh evidence replaces what an old try measured
        elif judged > 1:
            self.speculative = _ema(self.speculative, rate, 0.5)
        if self.trial == 0:
            self._spacing()

    def _spacing(self) -> None:
        """After a try: speculate on if it paid, else wait as long as the budget asks."""
        if self.speculative is not None and self.speculative >= self.plain:
            self.retry_every = self.wait = self.FIRST_RETRY
            return
        affordable = math.ceil(self.trial_extra / (self.EXPLORE_BUDGET * self.plain_step)) if self.plain_step else 0
        if self.trial_k > 1:  # perhaps a shorter bet pays: try it as soon as the budget allows
            self.k_cap = self.trial_k // 2
            self.wait = min(max(self.FIRST_RETRY, affordable), self.LAST_RETRY)
            return
        self.k_cap = None
        self.retry_every = self.wait = min(max(2 * self.retry_every, affordable), self.LAST_RETRY)


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


def batch_bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ..: batches of similar size cost alike."""
    return 1 << (batch_size - 1).bit_length()


class GoodputController(StaticController):
    mode = "goodput"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.realised: dict[int, Realised] = {}

    def realised_rates(self) -> dict[str, dict[str, float | None]]:
        """Measured tokens/s by batch-size bucket, as ``describe`` shows them."""
        return {f"B<={b}": {"plain": r.plain and round(r.plain, 1),
                            "speculative": r.speculative and round(r.speculative, 1)}
                for b, r in sorted(self.realised.items())}

    def observe_step(self, batch_size: int, k: int, tokens: int, seconds: float) -> None:
        """A whole decode step's outcome, proposing to emitting."""
        if seconds > 0:
            self.realised.setdefault(batch_bucket(batch_size), Realised()).observe(k, tokens, seconds)

    def plan(self, rows: list[Row], batch_size: int) -> tuple[list[int], str | None]:
        policy = self.policy
        asked = [r.budget for r in rows]
        if not any(asked):
            return asked, None
        if policy is not None and not policy.enabled:
            return [0] * len(rows), "policy_disabled"
        realised = self.realised.setdefault(batch_bucket(batch_size), Realised())
        measured = realised.decide()
        if measured is not None:
            return [0] * len(rows), measured
        ks, reason = self.choose(rows)
        if realised.k_cap is not None:
            ks = [min(k, realised.k_cap) for k in ks]
        return ks, reason

    def choose(self, rows: list[Row]) -> tuple[list[int], str | None]:
        """The cost model's choice: the k (and the rows) with the most expected tokens per second."""
        policy = self.policy
        asked = [r.budget for r in rows]
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
