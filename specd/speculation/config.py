"""What a SpecPolicy lets a model's speculation controller do."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicySettings:
    """What a SpecPolicy sets for a model's speculation controller (``mode``
    static|goodput).  The control plane converts the manifest's spec into it,
    so the algorithm does not depend on the API schema; the defaults are the
    manifest's."""

    enabled: bool = True
    mode: str = "goodput"
    max_speculative_tokens: int = 16
    disable_by_batch_size: int | None = None
    acceptance_rate_threshold: float = 0.0
    ema_alpha: float = 0.1
    probe_interval: int = 16
