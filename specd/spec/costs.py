"""Step costs learned online from the engine's own timings.

The goodput controller needs what a verify forward costs for B rows of W
tokens, and what one draft step costs for B rows, on *this* machine and
model, not constants.  Both are fitted by exponentially-forgetting least
squares on a two-term model: target seconds = a + b * B * W (dispatch cost
plus per-token work) and draft step seconds = d0 + d1 * B.  A weak ridge
prior (b = 0: tokens are free until measured otherwise) makes the first
speculative steps explore, and what they measure corrects it.
"""

from __future__ import annotations


class LinearFit:
    """y = p0 + p1 * x, weighted least squares with forgetting and a ridge prior."""

    def __init__(self, decay: float = 0.02, ridge: float = 1e-3):
        self.decay, self.ridge = decay, ridge
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - self.decay
        self.n = keep * self.n + 1
        self.sx = keep * self.sx + x
        self.sxx = keep * self.sxx + x * x
        self.sy = keep * self.sy + y
        self.sxy = keep * self.sxy + x * y

    @property
    def seen(self) -> bool:
        return self.n > 0

    def params(self) -> tuple[float, float]:
        if not self.seen:
            return 0.0, 0.0
        r = self.ridge * self.n
        det = self.n * (self.sxx + r) - self.sx * self.sx
        slope = (self.n * self.sxy - self.sx * self.sy) / det if det > 0 else 0.0
        slope = max(slope, 0.0)  # more tokens never cost less
        intercept = max((self.sy - slope * self.sx) / self.n, 0.0)
        return intercept, slope

    def predict(self, x: float) -> float:
        a, b = self.params()
        return a + b * x


class CostModel:
    def __init__(self):
        self.target = LinearFit()
        self.draft = LinearFit()

    def observe_target(self, rows: int, width: int, seconds: float) -> None:
        self.target.add(rows * width, seconds)

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        if rows and steps:
            self.draft.add(rows, seconds / steps)

    def target_seconds(self, rows: int, width: int) -> float:
        return max(self.target.predict(rows * width), 1e-6)

    def draft_seconds(self, rows: int, steps: int) -> float:
        return 0.0 if rows == 0 or steps == 0 else steps * self.draft.predict(rows)

    def draft_row_seconds(self) -> float:
        """Marginal draft cost of one more row for one step."""
        return self.draft.params()[1] if self.draft.seen else 0.0

    def snapshot(self) -> dict[str, float]:
        a, b = self.target.params()
        d0, d1 = self.draft.params()
        return {"target_fixed_s": a, "target_per_token_s": b, "draft_fixed_s": d0, "draft_per_row_s": d1}
