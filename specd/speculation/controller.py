"""Speculation controllers: how far each request speculates this step.

``StaticController`` is the seed policy (``mode: static``), and what rows
speculate by with no policy at all (as requests ask): an EMA of the model's
acceptance rate, speculation off when the batch reaches
``disableByBatchSize`` or the EMA falls below ``acceptanceRateThreshold``, k
capped by ``maxSpeculativeTokens``; while acceptance keeps speculation off,
every ``probeInterval``-th step still speculates so the EMA can recover. The
k asked is a ceiling: the cost model shortens it when a shorter proposal
yields more tokens per second (never to 0, which only a goodput policy may
choose, measuring plain steps beside it); with nothing measured yet, every
width is modelled alike and k stays as asked. A seeded sampling row keeps
its k, so that it samples the same alone or batched.

``GoodputController`` (``mode: goodput``) chooses, every step, the k that
maximises expected tokens per second of wall time for the whole batch, from
each request's own acceptance estimate and from step costs measured online
(``CostModel``).  The verify forward pads every row to the longest proposal,
so the batch shares one width; rows whose expected gain does not pay for
their drafting are left out, and k = 0 when speculating cannot pay at all.
The seconds it divides by are those of whole steps, measured side by side
(``exploration.Realised``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .acceptance import AcceptanceEstimate, AcceptanceHistory
from .config import PolicySettings
from .costs import CostModel
from .exploration import Realised, batch_bucket


@dataclass
class Row:
    """What a controller knows about one request this step."""

    budget: int  # the most it may propose (request's k within context/max_tokens)
    drafts_with_model: bool  # its proposals cost draft-model steps
    estimate: AcceptanceEstimate
    lookup: int = 0  # tokens a prompt lookup offers a draft-model row now (free: no draft step)
    # a seeded sampling row: how far it drafts decides how far its RNG stream advances, so it
    # keeps the k it asked for, to sample the same alone or batched
    seeded: bool = False

    def drafts(self, k: int) -> bool:
        """Whether proposing ``k`` tokens costs it draft-model steps (its lookup is shorter)."""
        return self.drafts_with_model and self.lookup < min(k, self.budget)


def proposes_lookup(rows: list[Row], ks: list[int]) -> list[bool]:
    """Which rows propose their prompt lookup if row i proposes ``ks[i]``: a draft-model row
    whose lookup covers its k, in a round where the draft model does not run (no such row
    lacks one); where it runs it drafts for every row (it runs them as one batch either way,
    and its proposals are accepted more often), but a seeded sampling row keeps its lookup,
    as drafting would advance its RNG, whose stream it draws alike alone or batched."""
    runs = any(k and r.drafts(k) for r, k in zip(rows, ks))
    return [bool(k) and r.drafts_with_model and not r.drafts(k) and (r.seeded or not runs)
            for r, k in zip(rows, ks)]


class StaticController:
    mode = "static"
    PRIOR_WEIGHT = 4.0  # how many rounds the model's history counts for a new request

    def __init__(self, policy: PolicySettings | None = None, name: str | None = None,
                 costs: CostModel | None = None, history: AcceptanceHistory | None = None):
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

    def plan(self, rows: list[Row], batch_size: int) -> tuple[list[int], str | None]:
        """The k each row may use now (its budget already applied), and why
        speculation is off this step if it is."""
        policy = self.policy
        asked = [r.budget for r in rows]
        if not any(asked):
            return asked, None
        if policy is None:
            return self.shortened(rows, asked), None
        if not policy.enabled:
            return [0] * len(rows), "policy_disabled"
        if policy.disable_by_batch_size is not None and batch_size >= policy.disable_by_batch_size:
            return [0] * len(rows), "batch_size"
        if self.ema is not None and self.ema < policy.acceptance_rate_threshold:
            self._steps_off += 1
            if self._steps_off % policy.probe_interval:
                return [0] * len(rows), "low_acceptance"
        return self.shortened(rows, [min(k, policy.max_speculative_tokens) for k in asked]), None

    def shortened(self, rows: list[Row], ks: list[int]) -> list[int]:
        """``ks`` cut to the k (at least 1) with the most expected tokens per second by the cost
        model, the longest on a tie: drafting and verifying a long proposal may cost more than its
        last tokens yield. Seeded sampling rows keep theirs (``Row.seeded``)."""
        longest = max(ks)
        if not self.costs.steps.relative:  # what a wider step costs is not known yet
            return ks
        best = max(range(longest, 0, -1), key=lambda k: self._rate_of(rows, [min(k, n) for n in ks]))
        return ks if best == longest else [n if r.seeded else min(best, n) for r, n in zip(rows, ks)]

    def _rate_of(self, rows: list[Row], ks: list[int]) -> float:
        """Expected tokens per second for the batch if row i proposes ``ks[i]`` (the draft model
        drafting for the rows that do not propose their lookup, ``proposes_lookup``)."""
        drafted = [k for r, k, lookup in zip(rows, ks, proposes_lookup(rows, ks))
                   if k and r.drafts_with_model and not lookup]
        seconds = (self.costs.target_seconds(len(rows), 1 + max(ks))
                   + self.costs.draft_seconds(len(drafted), max(drafted, default=0)))
        return self._expected(rows, ks) / seconds

    @staticmethod
    def _expected(rows: list[Row], ks: list[int]) -> float:
        """Expected tokens a step yields for the batch if row i proposes ``ks[i]``."""
        return sum(r.estimate.expected_tokens(k) for r, k in zip(rows, ks))

    def plain_next(self, batch_size: int) -> bool:
        """Whether the next step decodes plainly whatever the rows ask and expect (a disabled policy,
        or a batch at ``disableByBatchSize``): the runner may start it before this one's tokens are read."""
        policy = self.policy
        return policy is not None and (not policy.enabled or (policy.disable_by_batch_size is not None
                                                              and batch_size >= policy.disable_by_batch_size))

    def new_estimate(self) -> AcceptanceEstimate:
        """A request's starting estimate: the model's recent acceptance by position, weakly held."""
        return self.history.seed(self.PRIOR_WEIGHT)

    def measured_steps(self) -> dict[str, dict[str, float]]:
        """Measured step times by batch-size bucket (only the goodput controller measures them)."""
        return {}

    def observe_step(self, batch_size: int, seconds: float, caught_up: bool = False,
                     ran_ahead: bool | None = None) -> None:
        """A whole decode step's wall time (only the goodput controller uses it)."""

    def observe(self, estimates: list[AcceptanceEstimate], proposed: list[int], accepted: list[int],
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


class GoodputController(StaticController):
    mode = "goodput"

    def __init__(self, *args, realised: dict[int, Realised] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.realised = {} if realised is None else realised  # by batch-size bucket
        self._no_gain_rows: int | None = None  # rows of the last plan, when none of their estimates paid for a proposal

    def measured_steps(self) -> dict[str, dict[str, float]]:
        """Measured milliseconds of a whole step at each k and the best k by
        batch-size bucket, as ``describe`` shows them."""
        return {f"B<={b}": {"best": r.best, **{f"k={k}": round(1000 * v, 2) for k, v in sorted(r.seconds.items())}}
                for b, r in sorted(self.realised.items())}

    def plain_next(self, batch_size: int) -> bool:
        """Plain decoding measured best in the batch's bucket, and no try of speculating due next;
        or the last plan's rows, whose estimates paid for no proposal, with no probe due next (their
        estimates learn only from rounds, so a plain step leaves them as they were)."""
        if self.policy is not None and not self.policy.enabled:
            return True
        measured = self.realised.get(batch_bucket(batch_size))
        if measured is not None and measured.plain_next():
            return True
        return (self._no_gain_rows == batch_size and self.policy is not None
                and (self._steps_off + 1) % self.policy.probe_interval != 0)

    def observe_step(self, batch_size: int, seconds: float, caught_up: bool = False,
                     ran_ahead: bool | None = None) -> None:
        """A whole decode step's wall time, proposing to emitting; ``caught_up``:
        its draft also prefilled rows or fed them a backlog; ``ran_ahead``: a plain
        step's, whose rows could run ahead of the one before, whether it did."""
        measured = self.realised.get(batch_bucket(batch_size))
        if measured is not None:
            measured.observe(seconds, caught_up, ran_ahead)

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
                                    lambda k: self._expected(rows, self._ks(rows, k, self._worth_it(rows, k))))
        self._no_gain_rows = None
        if k == 0:
            return [0] * len(rows), reason
        ks, reason = self._for_rows(rows, k, self._worth_it(rows, k))
        if not any(ks):  # no row's estimate pays for a proposal
            self._no_gain_rows = batch_size
            measured.pending = None  # a plain step, not one at k: it measures neither
        return ks, reason

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
        return self._ks(rows, k, use), None

    @staticmethod
    def _ks(rows: list[Row], k: int, use: list[bool]) -> list[int]:
        return [min(k, r.budget) if u else 0 for r, u in zip(rows, use)]

    def _worth_it(self, rows: list[Row], k: int) -> list[bool]:
        """Rows whose expected extra tokens pay for the drafting they add."""
        per_row_draft = self.costs.draft_row_seconds(k)
        tokens_per_second = 1.0 / max(self.costs.target_seconds(len(rows), 1), 1e-6)
        use = []
        for r in rows:
            if r.budget == 0:
                use.append(False)
                continue
            gain = r.estimate.expected_tokens(min(k, r.budget)) - 1.0
            cost = per_row_draft * tokens_per_second if r.drafts(k) else 0.0
            use.append(gain > cost)
        return use

    def _rate(self, rows: list[Row], k: int, use: list[bool]) -> float:
        """Expected tokens per second for the batch if ``use`` rows propose up to k."""
        return self._rate_of(rows, self._ks(rows, k, use))


def make_controller(policy: PolicySettings | None, name: str | None, costs: CostModel,
                    realised: dict[int, Realised], history: AcceptanceHistory) -> StaticController:
    """The policy's controller; what was learned (costs, measured rates by k,
    the model's acceptance history) carries over."""
    if policy is not None and policy.mode == "goodput":
        return GoodputController(policy, name, costs, history, realised=realised)
    return StaticController(policy, name, costs, history)
