"""Acceptance estimates: how likely a request's proposals are to be accepted.

Each request keeps its acceptance by proposal position (``AcceptanceEstimate``),
from which the controllers read the tokens a round at k is expected to yield.
The model's history across requests (``AcceptanceHistory``) belongs to its
speculator, outlives policy swaps, and seeds each new request's estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
