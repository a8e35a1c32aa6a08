"""How a model (or a single request) speculates."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculationConfig:
    """``method`` none|ngram|draft; k proposals per round; n-gram match lengths."""

    method: str = "none"
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0


NO_SPECULATION = SpeculationConfig()
