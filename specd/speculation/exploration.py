"""The side-by-side try scheduler: which k the goodput controller uses, from measured steps.

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
from typing import Callable


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
    pair: a machine's speed can change from one spell of tens of steps to
    the next by more than neighbouring k differ, and only steps run
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
    costs relatively more as the batch grows, so they can only flatter it.

    Plain steps are valued as they run once chosen.  Chosen, they run ahead
    of one another (``runner.py``: the host builds the next while the device
    runs this one); a plain step interleaved with a try's, or a plain try
    among speculative steps, cannot, and costs the host's work on top.  So,
    where its rows could run ahead, a try's plain step is counted at the
    seconds of one that ran ahead: scaled by the two kinds' ratio, each an
    EMA of this bucket's (``plain_pace``: steps that ran ahead outside tries,
    and tries' plain steps, which could not; a request's first step cannot
    either, and is neither).  Judged by the slower kind, a try of k won
    against plain decoding that would then beat it."""

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
        self.plain_pace: dict[bool, float] = {}  # a plain step's seconds (EMA) by whether it ran ahead

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

    def plain_next(self) -> bool:
        """Whether the next ``decide`` is plain decoding whatever the rows' estimates: the baseline
        is still measured, or plain decoding is best, no try is under way and none can be due."""
        if self.baseline_left:
            return True
        if self.best != 0 or self.trying is not None:
            return False
        step = self.steps + 1
        if step >= self.next_try.get(self.PLAIN, 0):
            return False
        start = self.earliest.get(self.PLAIN)
        return not (start is not None and step >= start and (step - start) % self.FIRST_RETRY == 0)

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
        batch's rows."""
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

    def observe(self, seconds: float, caught_up: bool = False, ran_ahead: bool | None = None) -> None:
        """The wall time of the step last decided; ``caught_up``: its draft
        also prefilled rows or fed them a backlog; ``ran_ahead``: a plain step's,
        whose rows could run ahead of the one before, whether it did."""
        decided, self.pending = self.pending, None
        if decided is None or seconds <= 0:
            return
        k, trying = decided
        if k == 0 and ran_ahead is not None and ran_ahead == (self.trying is None):
            self.plain_pace[ran_ahead] = _ema(self.plain_pace.get(ran_ahead), seconds, self.ALPHA)
            if not ran_ahead and True in self.plain_pace:
                seconds *= min(1.0, self.plain_pace[True] / self.plain_pace[False])
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
        try back soon, its pairs pooling until they decide: one try's few
        pairs often leave a real gain undecided, and a backed-off retry would
        take thousands of steps to come back."""
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
