"""How a model (or a single request) speculates."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "ngram", "draft", "eagle")


@dataclass(frozen=True)
class SpeculationConfig:
    """``method`` none|ngram|draft|eagle; k proposals per round (an EAGLE
    tree's depth); n-gram match lengths; EAGLE tree shape (``tree_top_k`` 1
    drafts a chain; else each expansion keeps that many children and the
    tree is cut to ``tree_tokens`` nodes)."""

    method: str = "none"
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    tree_top_k: int = 1
    tree_tokens: int = 16

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0


NO_SPECULATION = SpeculationConfig()
