"""Step costs learned online from the engine's own timings.

The goodput controller needs what a decode step costs for B rows of W tokens
each (the verify forward plus acceptance and rollback), and what one draft
step costs for B rows, on *this* machine and model, not constants.  Both are
fitted by exponentially-forgetting least squares on linear models:

    step seconds       = a + b * B + c * B * (W - 1)   (fixed, per row, per extra token)
    draft step seconds = d0 + d1 * B

A weak ridge prior pulls unmeasured terms to 0 ("extra tokens are free until
measured otherwise"), so the first speculative steps explore and what they
measure corrects the model.
"""

from __future__ import annotations

import numpy as np


class LinearFit:
    """y = p . x by weighted least squares with forgetting and a ridge prior."""

    def __init__(self, features: int, decay: float = 0.02, ridge: float = 1e-6):
        self.decay, self.ridge = decay, ridge
        self.xx = np.zeros((features, features))
        self.xy = np.zeros(features)
        self.n = 0.0
        self._params: np.ndarray | None = None  # solved lazily: adds happen every step, reads rarely

    def add(self, x: list[float], y: float) -> None:
        v = np.asarray(x, dtype=np.float64)
        keep = 1.0 - self.decay
        self.xx = keep * self.xx + np.outer(v, v)
        self.xy = keep * self.xy + v * y
        self.n = keep * self.n + 1
        self._params = None

    @property
    def seen(self) -> bool:
        return self.n > 0

    def params(self) -> np.ndarray:
        if not self.seen:
            return np.zeros(len(self.xy))
        if self._params is None:
            a = self.xx + self.ridge * self.n * np.eye(len(self.xy))
            self._params = np.maximum(np.linalg.solve(a, self.xy), 0.0)  # more work never costs less
        return self._params

    def predict(self, x: list[float]) -> float:
        return float(self.params() @ np.asarray(x, dtype=np.float64))


class CostModel:
    def __init__(self):
        self.step = LinearFit(3)
        self.draft = LinearFit(2)

    @staticmethod
    def _step_features(rows: int, width: int) -> list[float]:
        return [1.0, rows, rows * (width - 1)]

    def observe_target(self, rows: int, width: int, seconds: float) -> None:
        self.step.add(self._step_features(rows, width), seconds)

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        if rows and steps:
            self.draft.add([1.0, rows], seconds / steps)

    def target_seconds(self, rows: int, width: int) -> float:
        return max(self.step.predict(self._step_features(rows, width)), 1e-6)

    def draft_seconds(self, rows: int, steps: int) -> float:
        return 0.0 if rows == 0 or steps == 0 else steps * self.draft.predict([1.0, rows])

    def draft_row_seconds(self) -> float:
        """Marginal draft cost of one more row for one step."""
        return float(self.draft.params()[1])

    def snapshot(self) -> dict[str, float]:
        a, b, c = self.step.params()
        d0, d1 = self.draft.params()
        return {"step_fixed_s": a, "step_per_row_s": b, "step_per_extra_token_s": c,
                "draft_fixed_s": d0, "draft_per_row_s": d1}
