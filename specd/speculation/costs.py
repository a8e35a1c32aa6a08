"""Step costs learned online from the engine's own timings.

The goodput controller needs what a decode step costs for B rows of W tokens
each (the verify forward plus acceptance and rollback), and what one draft
step costs for B rows, on *this* machine and model, not constants.

Decode steps are kept as a table of moving averages by (B, W): the cost of
extra tokens is not linear in B (a CPU is dispatch-bound at batch 1, where
verifying 4 tokens costs ~1.2 steps, and compute-bound at batch 16, where it
costs ~2), so a shape is predicted from its own measurements, else from the
nearest measured batch size at the same width, scaled to this batch's plain
step.  A width never measured at any batch size is assumed free, so the first
speculative steps explore, and what they measure corrects the table.  Draft
steps are fitted as d0 + d1 * B by least squares with forgetting.
"""

from __future__ import annotations


class StepCostTable:
    """Moving averages of decode-step seconds by (rows, width)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.seconds: dict[tuple[int, int], float] = {}

    def add(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - self.weight) * old + self.weight * seconds

    def _plain(self, rows: int) -> float:
        """A one-token step for ``rows`` rows: measured, else interpolated between batch sizes."""
        known = sorted((b, s) for (b, w), s in self.seconds.items() if w == 1)
        if not known:
            return 1e-3
        below = [(b, s) for b, s in known if b <= rows]
        above = [(b, s) for b, s in known if b >= rows]
        if below and above:
            (b0, s0), (b1, s1) = below[-1], above[0]
            return s0 if b1 == b0 else s0 + (s1 - s0) * (rows - b0) / (b1 - b0)
        (b0, s0) = below[-1] if below else above[0]
        return s0 * rows / b0 if below else s0  # more rows never cost less

    @property
    def relative(self) -> bool:
        """Whether some batch size has a wider step measured beside a plain one."""
        return any(w > 1 and (b, 1) in self.seconds for b, w in self.seconds)

    def _width_factor(self, rows: int, width: int) -> float:
        """How much a ``width`` step costs relative to a plain one, from the
        nearest batch size where such a width was measured (the larger one on
        a tie), extrapolated linearly in the extra tokens from the closest
        measured width.  With no speculative step measured at all: 1 (explore)."""
        factors = [(b, w, self.seconds[(b, w)] / self.seconds[(b, 1)])
                   for (b, w) in self.seconds if w > 1 and (b, 1) in self.seconds]
        if not factors:
            return 1.0
        b, w, factor = min(factors, key=lambda f: (abs(f[1] - width), abs(f[0] - rows), -f[0], -f[1]))
        return 1.0 + (factor - 1.0) * (width - 1) / (w - 1)

    def predict(self, rows: int, width: int) -> float:
        if (rows, width) in self.seconds:
            return self.seconds[(rows, width)]
        return self._plain(rows) * (1.0 if width == 1 else self._width_factor(rows, width))


class DraftStepFit:
    """Seconds of one draft step for B rows, d0 + d1 * B, by least squares with
    forgetting and a ridge prior.  Kept as running sums of plain floats and
    solved in closed form: it is fed every speculative step and read by
    every plan, where a numpy solve would show in a small batch's step."""

    def __init__(self, decay: float = 0.02, ridge: float = 1e-6):
        self.decay, self.ridge = decay, ridge
        self.n = self.rows = self.rows2 = self.y = self.rows_y = 0.0  # decayed sums of 1, B, B^2, y, B y
        self._params: tuple[float, float] | None = None  # solved lazily, once per add

    def add(self, rows: float, seconds: float) -> None:
        keep = 1.0 - self.decay
        self.n = keep * self.n + 1.0
        self.rows = keep * self.rows + rows
        self.rows2 = keep * self.rows2 + rows * rows
        self.y = keep * self.y + seconds
        self.rows_y = keep * self.rows_y + rows * seconds
        self._params = None

    @property
    def seen(self) -> bool:
        return self.n > 0

    def params(self) -> tuple[float, float]:
        if not self.seen:
            return 0.0, 0.0
        if self._params is None:
            ridge = self.ridge * self.n
            a, b, d = self.n + ridge, self.rows, self.rows2 + ridge
            det = a * d - b * b
            d0 = (d * self.y - b * self.rows_y) / det
            d1 = (a * self.rows_y - b * self.y) / det
            self._params = max(d0, 0.0), max(d1, 0.0)  # more work never costs less
        return self._params

    def predict(self, rows: float) -> float:
        d0, d1 = self.params()
        return d0 + d1 * rows


class CostModel:
    def __init__(self):
        self.steps = StepCostTable()
        self.draft = DraftStepFit()
        self.block_drafts = False  # the drafter drafts any k in one forward (DFlash): one step

    def _draft_steps(self, k: int) -> int:
        return min(k, 1) if self.block_drafts else k

    def observe_target(self, rows: int, width: int, seconds: float) -> None:
        self.steps.add(rows, width, seconds)

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        if rows and steps:
            self.draft.add(rows, seconds / steps)

    def target_seconds(self, rows: int, width: int) -> float:
        return max(self.steps.predict(rows, width), 1e-6)

    def draft_seconds(self, rows: int, k: int) -> float:
        """Drafting ``k`` tokens for ``rows`` rows."""
        return 0.0 if rows == 0 or k == 0 else self._draft_steps(k) * self.draft.predict(rows)

    def draft_row_seconds(self, k: int) -> float:
        """Marginal cost of drafting ``k`` tokens for one more row."""
        return self.draft.params()[1] * self._draft_steps(k)

    def snapshot(self) -> dict[str, float]:
        """Measured step seconds by shape (``B4xW2``) and the draft fit."""
        d0, d1 = self.draft.params()
        steps = {f"B{b}xW{w}": s for (b, w), s in sorted(self.steps.seconds.items())}
        return {**steps, "draft_fixed_s": d0, "draft_per_row_s": d1}
