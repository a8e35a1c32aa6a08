"""The speculation controller: how far each request may speculate this step.

``static`` mode is the seed policy: an EMA of the model's acceptance rate,
speculation off when the batch reaches ``disableByBatchSize`` or the EMA
falls below ``acceptanceRateThreshold``, k capped by ``maxSpeculativeTokens``.
While acceptance keeps speculation off, every ``PROBE_EVERY``-th step still
speculates so the EMA can recover when the text turns predictable.
"""

from __future__ import annotations

from ..api.manifest import SpecPolicySpec

PROBE_EVERY = 16


class StaticController:
    def __init__(self, policy: SpecPolicySpec | None = None, name: str | None = None):
        self.policy = policy
        self.policy_name = name
        self.ema: float | None = None
        self._steps_off = 0

    def limit(self, k: int, batch_size: int) -> tuple[int, str | None]:
        """The k a request asking for ``k`` may use now, and why it is 0 if so."""
        policy = self.policy
        if policy is None or k == 0:
            return k, None
        if not policy.enabled:
            return 0, "policy_disabled"
        if policy.disable_by_batch_size is not None and batch_size >= policy.disable_by_batch_size:
            return 0, "batch_size"
        if self.ema is not None and self.ema < policy.acceptance_rate_threshold:
            self._steps_off += 1
            if self._steps_off % PROBE_EVERY:
                return 0, "low_acceptance"
        return min(k, policy.max_speculative_tokens), None

    def observe(self, drafted: int, accepted: int) -> None:
        """Fold one step's acceptance into the model's EMA."""
        if drafted == 0:
            return
        rate = accepted / drafted
        alpha = self.policy.ema_alpha if self.policy is not None else 0.1
        self.ema = rate if self.ema is None else (1 - alpha) * self.ema + alpha * rate
