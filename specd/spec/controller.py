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
lazy draft prefill, cache effects), so the k actually used is the one
measured to pay: ``Realised`` keeps, per batch-size bucket, the tokens per
second of whole steps (proposing to emitting) at each k, uses the best, and
now and then tries its neighbours, the first try being the cost model's bet.
Tries are spaced so that losing ones cost at most 1% of the decode time each,
while a workload that turns repetitive is still noticed.  What was measured
outlives a policy swap, like the learned costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

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

    def realised_rates(self) -> dict[str, dict[str, float]]:
        """Measured tokens/s by batch-size bucket (only the goodput controller measures them)."""
        return {}

    def observe_step(self, batch_size: int, tokens: int, seconds: float) -> None:
        """A whole decode step's outcome (only the goodput controller uses it)."""

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
    """Measured tokens per second of each k (0: plain) in one batch-size
    bucket, and the k to use next.

    Plain decoding is measured first (``TRY`` steps), and the k in use is
    the measured best.  Its neighbours (k - 1 and k + 1) are tried now and then: a try is ``TRY`` steps at the neighbour's k, judged on
    all but its first (which pays for catching a draft's cache up, a one-off
    cost a request amortises over its life).  A try that wins makes its k the
    best (and the old best a neighbour, soon tried again, so one lucky try is
    undone); one that loses waits 16, 32, .. 1024 steps for the next, and
    never less than its cost beyond the best allows within ``EXPLORE_BUDGET``
    of the decode time.  A try is judged against the best k's rate of the
    steps just before it, never against an old measurement: this machine's
    speed drifts by tens of percent over minutes, more than the differences
    between neighbouring k.  Tokens per second rise with k to one best and
    fall after it, so climbing from neighbour to neighbour finds the best k
    without paying for tries of hopeless ones, and the first try goes where
    the cost model bets."""

    ALPHA = 0.1  # EMA weight of one step of the best k
    TRY = 8  # steps per try
    FIRST_RETRY, LAST_RETRY = 16, 1024  # steps between tries of a losing k
    EXPLORE_BUDGET = 0.01  # share of the decode time each neighbour's losing tries may cost

    def __init__(self) -> None:
        self.rate: dict[int, float] = {}  # tokens/s by k
        self.step_seconds: float | None = None  # a step of the best k
        self.best = 0
        self.steps = 0  # steps decided in this bucket
        self.next_try: dict[int, int] = {}  # k -> step from which it may be tried (again)
        self.retry: dict[int, int] = {}  # k -> spacing after its next losing try
        self.trying: int | None = None
        self.try_left = 0
        self.try_tokens = 0
        self.try_seconds = 0.0  # judged steps
        self.try_cost = 0.0  # seconds beyond what the best k would have taken, all steps
        self.pending: int | None = None  # the k decided for the step being run

    def decide(self, max_k: int, bet: Callable[[], int]) -> tuple[int, str | None]:
        """The k for this step (0: plain, with why): the best, or a neighbour's
        try when one is due; ``bet`` is the cost model's k for the first try."""
        self.steps += 1
        if 0 not in self.rate:  # plain decoding is measured first, like a try
            if self.trying is None:
                self._start(0)
            return self._run(0), "baseline"
        if self.trying is None and max_k > 0:
            due = [k for k in self._neighbours(max_k, bet) if self.steps >= self.next_try.get(k, 0)]
            if due:
                self._start(due[0])
        k = self.trying if self.trying is not None else min(self.best, max_k)
        return self._run(k), None if k else "no_gain"

    def _start(self, k: int) -> None:
        self.trying, self.try_left = k, self.TRY
        self.try_tokens, self.try_seconds, self.try_cost = 0, 0.0, 0.0

    def _neighbours(self, max_k: int, bet: Callable[[], int]) -> list[int]:
        if len(self.rate) == 1:  # only plain measured: the first try is the cost model's bet
            return [min(max(bet(), 1), max_k)]
        return [k for k in (self.best + 1, self.best - 1) if 0 <= k <= max_k]

    def _run(self, k: int) -> int:
        self.pending = k
        return k

    def observe(self, tokens: int, seconds: float) -> None:
        """The outcome of the step last decided: its tokens and wall time."""
        k, self.pending = self.pending, None
        if k is None or seconds <= 0:
            return
        rate = tokens / seconds
        if k != self.trying:
            self.rate[k] = _ema(self.rate.get(k), rate, self.ALPHA)
            if k == self.best:
                self.step_seconds = _ema(self.step_seconds, seconds, self.ALPHA)
            return
        self.try_left -= 1
        if self.best in self.rate:
            self.try_cost += seconds - tokens / self.rate[self.best]
        if self.try_left < self.TRY - 1:  # the first step catches up; judge the rest
            self.try_tokens += tokens
            self.try_seconds += seconds
        if self.try_left == 0:
            self._judge(k)

    def _judge(self, k: int) -> None:
        self.trying = None
        rate = self.try_tokens / self.try_seconds
        if k == self.best:  # the baseline
            self.rate[k] = rate
            self.step_seconds = self.try_seconds / (self.TRY - 1)
            return
        self.rate[k] = rate
        if rate > self.rate[self.best]:
            old, self.best = self.best, k
            self.step_seconds = self.try_seconds / (self.TRY - 1)
            self.retry[old] = self.FIRST_RETRY
            self.next_try[old] = self.steps + self.FIRST_RETRY
            return
        spacing = self.retry.get(k, self.FIRST_RETRY)
        affordable = math.ceil(self.try_cost / (self.EXPLORE_BUDGET * self.step_seconds)) if self.step_seconds else 0
        self.next_try[k] = self.steps + min(max(spacing, affordable), self.LAST_RETRY)
        self.retry[k] = min(2 * spacing, self.LAST_RETRY)


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


def batch_bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ..: batches of similar size cost alike."""
    return 1 << (batch_size - 1).bit_length()


class GoodputController(StaticController):
    mode = "goodput"

    def __init__(self, *args, realised: dict[int, Realised] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.realised = {} if realised is None else realised  # by batch-size bucket

    def realised_rates(self) -> dict[str, dict[str, float]]:
        """Measured tokens/s of each k and the best k by batch-size bucket, as ``describe`` shows them."""
        return {f"B<={b}": {"best": r.best, **{f"k={k}": round(v, 1) for k, v in sorted(r.rate.items())}}
                for b, r in sorted(self.realised.items())}

    def observe_step(self, batch_size: int, tokens: int, seconds: float) -> None:
        """A whole decode step's outcome, proposing to emitting."""
        measured = self.realised.get(batch_bucket(batch_size))
        if measured is not None:
            measured.observe(tokens, seconds)

    def plan(self, rows: list[Row], batch_size: int) -> tuple[list[int], str | None]:
        """The measured best k (or a neighbour's try) for the rows whose expected gain pays for it."""
        policy = self.policy
        asked = [r.budget for r in rows]
        if not any(asked):
            return asked, None
        if policy is not None and not policy.enabled:
            return [0] * len(rows), "policy_disabled"
        measured = self.realised.setdefault(batch_bucket(batch_size), Realised())
        k, reason = measured.decide(self._cap(rows), lambda: max(self.choose(rows)[0]))
        if k == 0:
            return [0] * len(rows), reason
        return self._for_rows(rows, k, self._worth_it(rows, k))

    def choose(self, rows: list[Row]) -> tuple[list[int], str | None]:
        """The cost model's choice: the k (and the rows) with the most expected tokens per second."""
        best_k, best_rate, best_rows = 0, self._rate(rows, 0, [False] * len(rows)), [False] * len(rows)
        for k in range(1, self._cap(rows) + 1):
            use = self._worth_it(rows, k)
            rate = self._rate(rows, k, use)
            if rate > best_rate * 1.0001:
                best_k, best_rate, best_rows = k, rate, use
        return self._for_rows(rows, best_k, best_rows)

    def _cap(self, rows: list[Row]) -> int:
        longest = max(r.budget for r in rows)
        return longest if self.policy is None else min(longest, self.policy.max_speculative_tokens)

    def _for_rows(self, rows: list[Row], k: int, use: list[bool]) -> tuple[list[int], str | None]:
        """k for the rows in ``use``; with none, every ``probeInterval``-th
        such step still lets one request speculate (in turn), so estimates
        can recover cheaply when a text turns repetitive."""
        self._steps_off += 1
        if k == 0 or not any(use):
            if self.policy is None or self._steps_off % self.policy.probe_interval:
                return [0] * len(rows), "no_gain"
            candidates = [i for i, r in enumerate(rows) if r.budget > 0]
            self._probe_cursor += 1
            chosen = candidates[self._probe_cursor % len(candidates)]
            k, use = 1, [i == chosen for i in range(len(rows))]
        self._steps_off = 0
        return [min(k, r.budget) if u else 0 for r, u in zip(rows, use)], None

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

def make_controller(policy: SpecPolicySpec | None, name: str | None, costs: CostModel,
                    realised: dict[int, Realised]) -> StaticController:
    """The policy's controller; what was learned (costs, measured rates by k) carries over."""
    if policy is not None and policy.mode == "goodput":
        return GoodputController(policy, name, costs, realised=realised)
    return StaticController(policy, name, costs)
