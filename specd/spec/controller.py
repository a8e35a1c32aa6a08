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

A model of costs misses whatever it does not model (proposal bookkeeping,
cache effects), so the seconds the choice divides by are measured:
``Realised`` keeps, per batch-size bucket, the wall time of whole steps
(proposing to emitting) at each k, uses the k with the most expected tokens
per second, and now and then tries its neighbours to measure them (plain
decoding's neighbour being the cost model's bet). Tries are spaced so that
losing ones cost at most 1% of the decode time each, while a workload that
turns repetitive is still noticed. What was measured outlives a policy swap,
like the learned costs and the model's acceptance history
(``AcceptanceHistory``), from which a new request's estimate starts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

from ..api.manifest import SpecPolicySpec
from .costs import CostModel


class StaticController:
    mode = "static"
    PRIOR_WEIGHT = 4.0  # how many rounds the model's history counts for a new request

    def __init__(self, policy: SpecPolicySpec | None = None, name: str | None = None,
                 costs: CostModel | None = None, history: "AcceptanceHistory | None" = None):
        self.policy = policy
        self.policy_name = name
        self.costs = costs or CostModel()
        self.history = history or AcceptanceHistory()
        self._steps_off = 0
        self._probe_cursor = -1

    @property
    def ema(self) -> float | None:
        """The model's moving average of the acceptance rate of proposed tokens."""
        return self.history.ema

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
        """A request's starting estimate: the model's recent acceptance by position, weakly held."""
        return self.history.seed(self.PRIOR_WEIGHT)

    def measured_steps(self) -> dict[str, dict[str, float]]:
        """Measured step times by batch-size bucket (only the goodput controller measures them)."""
        return {}

    def observe_step(self, batch_size: int, seconds: float, caught_up: bool = False) -> None:
        """A whole decode step's wall time (only the goodput controller uses it)."""

    def observe(self, estimates: list["AcceptanceEstimate"], proposed: list[int], accepted: list[int],
                planned: list[int]) -> None:
        """Fold one step's acceptance into the model's history and each
        request's estimate (of the k planned: an n-gram lookup that found
        fewer tokens fails at the first one it lacked, so the estimate says
        what choosing k yields)."""
        drafted = sum(proposed)
        if drafted == 0 and not any(planned):
            return
        alpha = self.policy.ema_alpha if self.policy is not None else 0.1
        if drafted:
            self.history.observe_rate(sum(accepted) / drafted, alpha)
        for estimate, k, a in zip(estimates, planned, accepted):
            if k:
                estimate.update(k, a, alpha)


@dataclass
class AcceptanceEstimate:
    """A request's acceptance by proposal position: for each position, decayed
    counts of the rounds that reached it and of those that accepted it,
    started from a prior worth ``weight`` rounds that fades like any round.
    Acceptance is often bursty (a copied span is taken whole or not at all,
    so a proposal that got past its first token tends to go on), and one rate
    for every position would overestimate what long proposals yield."""

    prior: float  # acceptance of a position not observed yet
    weight: float  # how many rounds the prior counts for
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    rounds: int = 0  # rounds observed

    def at(self, position: int) -> float:
        """The chance that a proposal reaching ``position`` (0-based) has it accepted."""
        if position >= len(self.reached):
            return self.prior
        return self.accepted[position] / self.reached[position]

    def expected_tokens(self, k: int) -> float:
        """Tokens a round with k proposals yields: the target's own, plus each
        proposal whose predecessors and itself were accepted."""
        tokens, chain = 1.0, 1.0
        for position in range(k):
            chain *= self.at(position)
            tokens += chain
        return tokens

    def update(self, k: int, accepted: int, decay: float) -> None:
        """A round planned at k that had ``accepted`` proposals accepted (a
        position its proposer could not fill counts as rejected): the
        positions it reached (the accepted ones and the first rejected) move."""
        grow = k - len(self.reached)
        if grow > 0:
            self.reached += [self.weight] * grow
            self.accepted += [self.prior * self.weight] * grow
        self.rounds += 1
        keep = 1.0 - decay
        for position in range(min(accepted + 1, k)):
            self.reached[position] = keep * self.reached[position] + 1
            self.accepted[position] = keep * self.accepted[position] + (position < accepted)


class AcceptanceHistory:
    """A model's acceptance across its requests, kept by its speculator so
    that it outlives policy swaps (a swap used to reset it, and every request
    after one started from a flat 50%).  ``ema`` is the moving average of
    the acceptance rate of proposed tokens (the static mode's signal, and a
    metric).  ``positions`` averages the per-position estimates of the last
    ten or so requests that speculated, each counted once when it leaves,
    and seeds a new request's estimate, so that its expected tokens at long
    k reflect how bursty the workload's acceptance is before it has run a
    round of its own.  Requests, not rounds, are pooled: the requests of a
    batch often end together, and their last rounds (an output falling into
    a loop, say) would speak for the next ones."""

    DECAY = 0.1  # weight of one request in ``positions``

    def __init__(self) -> None:
        self.ema: float | None = None
        self.positions = AcceptanceEstimate(0.5, 1.0)

    def observe_rate(self, rate: float, alpha: float) -> None:
        """One step's acceptance rate of proposed tokens."""
        self.ema = rate if self.ema is None else (1 - alpha) * self.ema + alpha * rate
        self.positions.prior = self.ema  # for positions no round has reached yet

    def absorb(self, estimate: AcceptanceEstimate) -> None:
        """A request that leaves: its estimate by position joins the pool (if it ever speculated)."""
        if not estimate.rounds:
            return
        pool, keep = self.positions, 1.0 - self.DECAY
        grow = len(estimate.reached) - len(pool.reached)
        if grow > 0:
            pool.reached += [0.0] * grow
            pool.accepted += [0.0] * grow
        for position in range(len(estimate.reached)):
            pool.reached[position] = keep * pool.reached[position] + 1.0
            pool.accepted[position] = keep * pool.accepted[position] + estimate.at(position)

    def by_position(self) -> list[float]:
        """The pooled chance that a proposal reaching each position has it accepted."""
        return [self.positions.at(i) for i in range(len(self.positions.reached))]

    def seed(self, weight: float) -> AcceptanceEstimate:
        """A new request's estimate: the acceptance by position seen so far, worth ``weight`` rounds."""
        rates = self.by_position()
        return AcceptanceEstimate(self.positions.prior, weight, [weight] * len(rates), [r * weight for r in rates])


@dataclass
class Row:
    """What a controller knows about one request this step."""

    budget: int  # the most it may propose (request's k within context/max_tokens)
    drafts_with_model: bool  # its proposals cost draft-model steps
    estimate: AcceptanceEstimate


class Realised:
    """Measured seconds of whole decode steps (proposing to emitting) at each
    k (0: plain) in one batch-size bucket, and the k to use next.

    The k in use is the one with the most expected tokens per second: the
    rows' expected tokens at k (``tokens``, from each request's acceptance
    estimate) over the measured seconds of a step at k.  Tokens are expected,
    not counted: a try's few steps yield 1 to k + 1 tokens a row by chance,
    which would decide more tries than k does, while the estimates pool every
    round the requests ran.  Seconds are measured, not modelled: they include
    whatever the cost model misses (proposal bookkeeping, cache effects).

    Plain decoding is measured first (``TRY`` steps).  The best k's
    neighbours are tried now and then: k - 1, k + 1 and plain decoding while
    speculating, the cost model's best k >= 1 while not (speculating pays a
    fixed overhead first, so k = 1 can lose to plain decoding where k = 2
    wins).  A try is ``TRY`` steps at the neighbour's k, each followed by a
    step at the best k, and is judged against those interleaved steps pair by
    pair: this machine's speed changes by up to 40% from one spell of tens of
    steps to the next, more than neighbouring k differ, and only steps run
    side by side see the same speed; a try wins only by a margin its pairs,
    pooled with those of the k's earlier undecided tries, agree on (``CLEAR``
    standard errors).  Steps whose draft caught rows up (a new request's
    prefill, or the backlog of a request that was not drafting) are left out
    of every measurement: a request pays that once in its life.  A try that
    wins makes its k the best (and the old best a neighbour, soon tried
    again, against the winning pairs reversed); one that shows a gain not yet
    clear comes back soon to add pairs; one that shows none waits 16, 32, ..
    1024 steps for the next (from plain decoding, one schedule whatever k is
    tried), and never less than its cost beyond the best allows within
    ``EXPLORE_BUDGET`` of the decode time (at a large batch, where a try's
    draft prefill and wide verify steps cost most, that is the longer wait).
    A backed-off try of a longer k comes back as soon as that budget allows
    once the rows' expected tokens have risen enough to pay for the seconds
    its latest try measured (``PROMISING``).  Among k >= 1, tokens per
    second rise with k to one best and fall after it, so climbing from
    neighbour to neighbour finds the best k without paying for tries of
    hopeless ones.

    At a large batch a try from plain decoding is costly (the draft catches
    every row up first: more than the usual longest wait amortises within
    the budget), and on a compute-bound target it loses by tens of percent,
    try after try.  So the seconds of such a try's k relative to plain
    decoding, measured side by side, are kept (``versus_plain``); while such
    measurements are fresh (``STALE`` steps), a due try of k whose expected
    tokens fall ``HOPELESS`` short of paying for the seconds measured at k
    or below waits another spacing without running.  Expected tokens are
    re-read at every due time, so text that turns repetitive still gets its
    try.  Cheap tries are not skipped: one try's verdict can be off by tens
    of percent, and only backing off bounds what such an error costs.  A new
    bucket starts from the nearest smaller one's measurements: speculating
    costs relatively more as the batch grows, so they can only flatter it."""

    ALPHA = 0.1  # EMA weight of one step of the best k
    TRY = 8  # steps per try (and pairs with the best k's steps)
    CLEAR = 2.0  # standard errors of its pairs by which a try must beat the best k
    FIRST_RETRY, LAST_RETRY = 16, 1024  # steps between tries of a losing k
    POOL = 32  # pairs of evidence kept on each k against the best
    PLAIN = -1  # the key of the one try schedule from plain decoding
    EXPLORE_BUDGET = 0.01  # share of the decode time each neighbour's losing tries may cost
    HOPELESS = 0.15  # log tokens/s by which a k measured against plain decoding must fall short to skip its try
    PROMISING = 0.1  # log tokens/s by which a backed-off k's expected tokens must now beat its measured seconds
    STALE = 8192  # steps after which such a measurement no longer skips tries

    def __init__(self, versus_plain: dict[int, float] | None = None) -> None:
        self.seconds: dict[int, float] = {}  # a step's seconds by k
        self.best = 0
        self.baseline_left = self.TRY  # plain steps to measure before any try
        self.steps = 0  # steps decided in this bucket
        self.next_try: dict[int, int] = {}  # k (or PLAIN) -> step from which it may be tried (again)
        self.retry: dict[int, int] = {}  # k (or PLAIN) -> spacing after its next try without a gain
        self.evidence: dict[int, list[float]] = {}  # k -> its latest pairs' advantages over the best
        self.trying: int | None = None
        self.best_turn = False  # during a try: the next step is the best k's, interleaved
        # during a try, per pair: a try step's seconds and expected tokens, then the best k's step's after it
        self.pairs: list[list[float]] = []
        self.try_cost = 0.0  # seconds beyond what the best k would have taken, all steps
        self.pending: tuple[int, bool] | None = None  # the k decided for the step being run, and if it is a try's
        self.tokens: Callable[[int], float] = lambda k: 1.0  # expected tokens by k, rows of the latest step
        # k -> (a step's seconds at k over a plain step's, measured side by side; the step it was measured at)
        self.versus_plain: dict[int, tuple[float, int]] = {k: (r, 0) for k, r in (versus_plain or {}).items()}
        self.costlier: dict[int, float] = {}  # k -> log seconds of a step at k over the best's, from its latest try
        self.earliest: dict[int, int] = {}  # k (or PLAIN) -> step from which a promising try may come early

    def decide(self, max_k: int, bet: Callable[[], int], tokens: Callable[[int], float]) -> tuple[int, str | None]:
        """The k for this step (0: plain, with why): the best, or a neighbour's
        try when one is due; ``bet`` is the cost model's best k >= 1,
        ``tokens`` the rows' expected tokens at a k."""
        self.steps += 1
        self.tokens = tokens
        if self.baseline_left:  # plain decoding is measured first
            return self._run(0, False), "baseline"
        if self.trying is None and max_k > 0:
            due = self._due_neighbour(max_k, bet)
            if due is not None:
                self.trying, self.best_turn, self.pairs, self.try_cost = due, False, [], 0.0
        trying = self.trying is not None and not self.best_turn
        if self.trying is not None:
            self.best_turn = not self.best_turn
        k = self.trying if trying else min(self.best, max_k)
        return self._run(k, trying), None if k else "no_gain"

    def rate(self, k: int) -> float:
        """Expected tokens per second at k for the rows of the latest step."""
        return self.tokens(k) / self.seconds[k]

    def _due_neighbour(self, max_k: int, bet: Callable[[], int]) -> int | None:
        """The neighbour whose try is due, if any.  From plain decoding the
        neighbour is the bet, on one schedule whatever k it names: the bet
        moves with the acceptance estimates, and a schedule per k would
        multiply the tries."""
        if self.best == 0:
            due = self.steps >= self.next_try.get(self.PLAIN, 0)
            if not (due or self._asks_early(self.PLAIN)):
                return None
            k = min(bet(), max_k)
            if not (due or self._promising(k)):
                return None
            if self._hopeless(k):  # waits another spacing, at no cost
                self.next_try[self.PLAIN] = self.steps + self.retry.get(self.PLAIN, self.FIRST_RETRY)
                return None
            return k
        return next((k for k in dict.fromkeys((self.best + 1, self.best - 1, 0))
                     if k <= max_k and (self.steps >= self.next_try.get(k, 0)
                                        or self._asks_early(k) and self._promising(k))), None)

    def _asks_early(self, key: int) -> bool:
        """Whether a backed-off try (k, or PLAIN) is asked now if it is
        promising: every ``FIRST_RETRY`` steps from its earliest step, not
        every step, as the bet and the expected tokens are passes over the
        batch's rows (0.25 ms at 16 rows, 2% of a plain step here)."""
        start = self.earliest.get(key)
        return start is not None and self.steps >= start and (self.steps - start) % self.FIRST_RETRY == 0

    def _promising(self, k: int) -> bool:
        """A backed-off try of a longer k comes early when the rows' expected
        tokens at k now beat the best's by ``PROMISING`` more than its latest
        try measured its seconds to cost (or a shorter k's beyond the best,
        which cost no more: from plain decoding the bet moves): text that
        turned repetitive is noticed as soon as losing tries can afford, not
        after the longest back-off.  A try showing no gain was judged on
        tokens expected then, so only a change since brings it back.  Only
        longer k come early: at a batch of one a request's estimate swings
        from request to request, and early tries of shorter k (on a dip)
        cost more than they found in the simulated bench."""
        gap = max((g for j, g in self.costlier.items() if self.best < j <= k), default=None)
        return gap is not None and math.log(self.tokens(k) / self.tokens(self.best)) - gap > self.PROMISING

    def fresh_versus_plain(self) -> dict[int, float]:
        """k -> a step's seconds at k over a plain step's, from side-by-side measurements still fresh."""
        return {k: ratio for k, (ratio, at) in self.versus_plain.items() if self.steps - at < self.STALE}

    def _hopeless(self, k: int) -> bool:
        """From plain decoding: the rows' expected tokens at k fall far short of
        paying for its seconds, as fresh measurements bound them (a step at k
        costs at least what one at any smaller k did)."""
        bound = max((ratio for j, ratio in self.fresh_versus_plain().items() if j <= k), default=None)
        return bound is not None and math.log(self.tokens(k) / self.tokens(0)) - math.log(bound) < -self.HOPELESS

    def _run(self, k: int, trying: bool) -> int:
        self.pending = k, trying
        return k

    def observe(self, seconds: float, caught_up: bool = False) -> None:
        """The wall time of the step last decided; ``caught_up``: its draft
        also prefilled rows or fed them a backlog."""
        decided, self.pending = self.pending, None
        if decided is None or seconds <= 0:
            return
        k, trying = decided
        if trying:
            self.try_cost += seconds - self.tokens(k) / self.rate(self.best)
        if caught_up:
            return
        if trying:  # opens a pair (or replaces one whose best step was not measured)
            if self.pairs and len(self.pairs[-1]) == 2:
                self.pairs.pop()
            self.pairs.append([seconds, self.tokens(k)])
            return
        self.seconds[k] = _ema(self.seconds.get(k), seconds, self.ALPHA)
        if k == 0 and self.baseline_left:
            self.baseline_left -= 1
        if self.trying is not None and k == self.best and self.pairs and len(self.pairs[-1]) == 2:
            self.pairs[-1] += [seconds, self.tokens(k)]
            if len(self.pairs) == self.TRY:
                self._judge(self.trying)

    def _judge(self, k: int) -> None:
        """A try's verdict from its pairs and the earlier tries' (the latest
        ``POOL`` pairs of k against this best): each pair's advantage is the
        try's in log expected tokens per second, each step's tokens expected
        for its own rows (a request ending or starting changes what a step can
        yield: the last step's rows would misjudge the others).  The try wins
        when the pairs' mean is ``CLEAR`` standard errors above zero, so that
        neither a slow spell nor a lucky one decides, only a difference the
        pairs agree on.  A mean at or below zero shows no gain: the try waits
        longer each time, and the next starts its evidence afresh (the
        workload may have changed by then).  A gain not yet clear brings the
        try back soon, its pairs pooling until they decide: one try's 8 pairs
        leave a true 10% gain undecided about half the time on this machine,
        and a backed-off retry took thousands of steps to come back."""
        self.trying = None
        pairs, self.pairs = self.pairs, []
        self.seconds[k] = statistics.fmean(p[0] for p in pairs)
        self.seconds[self.best] = statistics.fmean(p[2] for p in pairs)  # at the speed the try saw
        if self.best == 0 and self.try_cost > self.EXPLORE_BUDGET * self.LAST_RETRY * self.seconds[0]:
            self.versus_plain[k] = (self.seconds[k] / self.seconds[0], self.steps)
        advantages = [math.log(tokens_a / a) - math.log(tokens_b / b) for a, tokens_a, b, tokens_b in pairs]
        gap = statistics.fmean(math.log(a / b) for a, _, b, _ in pairs)
        pool = self.evidence[k] = (self.evidence.get(k, []) + advantages)[-self.POOL:]
        mean, error = statistics.fmean(pool), statistics.stdev(pool) / math.sqrt(len(pool))
        key = self.PLAIN if self.best == 0 else k
        if mean > self.CLEAR * error:
            old, self.best = self.best, k
            self.evidence = {old: [-a for a in pool]}  # the old best against the new; the rest was against the old
            self.costlier = {old: -gap}
            back = self.PLAIN if k == 0 else old
            self.retry[back] = self.FIRST_RETRY
            self.next_try[back] = self.steps + self.FIRST_RETRY
            return
        spacing = self.retry.get(key, self.FIRST_RETRY)
        affordable = math.ceil(self.try_cost / (self.EXPLORE_BUDGET * self.seconds[self.best]))
        self.costlier[k] = gap
        self.earliest[key] = self.steps + max(self.FIRST_RETRY, affordable)
        if mean <= 0:
            del self.evidence[k]
            self.next_try[key] = self.steps + max(min(spacing, self.LAST_RETRY), affordable)
            self.retry[key] = min(2 * spacing, self.LAST_RETRY)
        else:
            self.next_try[key] = self.steps + max(self.FIRST_RETRY, affordable)


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

    def measured_steps(self) -> dict[str, dict[str, float]]:
        """Measured milliseconds of a whole step at each k and the best k by
        batch-size bucket, as ``describe`` shows them."""
        return {f"B<={b}": {"best": r.best, **{f"k={k}": round(1000 * v, 2) for k, v in sorted(r.seconds.items())}}
                for b, r in sorted(self.realised.items())}

    def observe_step(self, batch_size: int, seconds: float, caught_up: bool = False) -> None:
        """A whole decode step's wall time, proposing to emitting; ``caught_up``:
        its draft also prefilled rows or fed them a backlog."""
        measured = self.realised.get(batch_bucket(batch_size))
        if measured is not None:
            measured.observe(seconds, caught_up)

    def plan(self, rows: list[Row], batch_size: int) -> tuple[list[int], str | None]:
        """The k with the most expected tokens per second over measured step
        times (or a neighbour's try), for the rows whose expected gain pays for it."""
        policy = self.policy
        asked = [r.budget for r in rows]
        if not any(asked):
            return asked, None
        if policy is not None and not policy.enabled:
            return [0] * len(rows), "policy_disabled"
        measured = self._measured(batch_bucket(batch_size))
        k, reason = measured.decide(self._cap(rows), lambda: self.bet(rows),
                                    lambda k: self._tokens(rows, k, self._worth_it(rows, k)))
        if k == 0:
            return [0] * len(rows), reason
        return self._for_rows(rows, k, self._worth_it(rows, k))

    def _measured(self, bucket: int) -> Realised:
        """The bucket's measurements; a new bucket starts from the nearest
        smaller one's costs of speculating relative to plain decoding."""
        if bucket not in self.realised:
            smaller = max((b for b in self.realised if b < bucket), default=None)
            self.realised[bucket] = Realised(None if smaller is None else self.realised[smaller].fresh_versus_plain())
        return self.realised[bucket]

    def choose(self, rows: list[Row]) -> tuple[list[int], str | None]:
        """The cost model's plan alone: its bet, for the rows whose expected
        gain pays for it, if that beats plain decoding by modelled costs."""
        k, none = self.bet(rows), [False] * len(rows)
        use = self._worth_it(rows, k)
        if self._rate(rows, k, use) > self._rate(rows, 0, none) * 1.0001:
            return self._for_rows(rows, k, use)
        return self._for_rows(rows, 0, none)

    def bet(self, rows: list[Row]) -> int:
        """The cost model's best k >= 1: where speculating would pay most, if it pays at all."""
        def rate(k: int) -> float:
            use = self._worth_it(rows, k)
            return self._rate(rows, k, use if any(use) else [r.budget > 0 for r in rows])
        return max(range(1, self._cap(rows) + 1), key=rate)

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
            gain = r.estimate.expected_tokens(min(k, r.budget)) - 1.0
            cost = per_row_draft * tokens_per_second if r.drafts_with_model else 0.0
            use.append(gain > cost)
        return use

    def _rate(self, rows: list[Row], k: int, use: list[bool]) -> float:
        """Expected tokens per second for the batch if ``use`` rows propose up to k."""
        width = 1 + (k if any(use) else 0)
        drafting = sum(1 for r, u in zip(rows, use) if u and r.drafts_with_model)
        seconds = self.costs.target_seconds(len(rows), width) + self.costs.draft_seconds(drafting, k)
        return self._tokens(rows, k, use) / seconds

    @staticmethod
    def _tokens(rows: list[Row], k: int, use: list[bool]) -> float:
        """Expected tokens a step yields for the batch if ``use`` rows propose up to k."""
        return sum(r.estimate.expected_tokens(min(k, r.budget)) if u else 1.0 for r, u in zip(rows, use))


def make_controller(policy: SpecPolicySpec | None, name: str | None, costs: CostModel,
                    realised: dict[int, Realised], history: AcceptanceHistory) -> StaticController:
    """The policy's controller; what was learned (costs, measured rates by k,
    the model's acceptance history) carries over."""
    if policy is not None and policy.mode == "goodput":
        return GoodputController(policy, name, costs, history, realised=realised)
    return StaticController(policy, name, costs, history)
