"""The forge's recipes: what each preset builds, and how long it may train.

Everything that changes the output belongs in a ``Recipe``: its hash keys
the on-disk cache, so bump ``RECIPE_VERSION`` when code changes the result
without changing a field here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, replace

from .llama import LlamaShape
from .train import TrainConfig

RECIPE_VERSION = 2
BUDGET_ENV = "SPECD_FORGE_BUDGET_S"
PRESETS = ("test", "quick", "demo")
QUICK_BUDGET_S = 45.0


@dataclass(frozen=True)
class Recipe:
    preset: str
    vocab_size: int
    tokenizer_corpus_bytes: int
    target: LlamaShape
    draft: LlamaShape
    # Random presets: init scales (embedding, projections, untied head).
    init_std: tuple[float, float, float] = (0.02, 0.02, 0.02)
    target_train: TrainConfig | None = None
    draft_train: TrainConfig | None = None
    mtp_train: TrainConfig | None = None  # an MTP head trained into the target's checkpoint
    dflash_train: TrainConfig | None = None  # a DFlash block drafter for the target, in ``dflash/``
    val_every: int = 20  # every n-th stdlib file is held out for validation
    val_windows: int = 256

    @property
    def trained(self) -> bool:
        return self.target_train is not None

    def as_dict(self, seed: int) -> dict:
        return {
            "version": RECIPE_VERSION,
            "seed": seed,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            **asdict(self),
        }

    def digest(self, seed: int) -> str:
        blob = json.dumps(self.as_dict(seed), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _test() -> Recipe:
    """A random pair in seconds, for the test suite.

    The draft is the target's first layer (same embeddings, norm and head), so
    the two agree on a good share of tokens (about 60%) and speculative
    decoding sees both accepted and rejected proposals. Large embedding and
    head scales with an untied head keep greedy top-1 margins far above float
    noise and avoid the repeat-the-input-token attractor of tied random models.
    """
    target = LlamaShape(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1024,
        tie_word_embeddings=False,
    )
    return Recipe(
        preset="test",
        vocab_size=1024,
        tokenizer_corpus_bytes=1_000_000,
        target=target,
        draft=replace(target, num_hidden_layers=1),
        init_std=(1.0, 0.1, 0.5),
        val_windows=32,
    )


def _demo(budget_s: float) -> Recipe:
    """A briefly trained pair: a 6-layer target, then a distilled 2-layer draft, then an
    MTP head in the target's checkpoint (``method: mtp``) and a 2-layer DFlash drafter
    (``method: dflash``).

    ``budget_s`` is the wall-clock training budget of the pair, split ~72/28 between
    the target (which needs it most: undertrained it loses to the draft) and the
    draft; the MTP head has 40% of it on top, and the DFlash drafter 80% (it learns a whole
    block from each anchor, and is still improving there). Step caps bind first on an unloaded
    machine, for reproducibility.
    """
    target = LlamaShape(
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=704,
        vocab_size=4096,
    )
    draft = LlamaShape(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=352,
        vocab_size=4096,
    )
    return Recipe(
        preset="demo",
        vocab_size=4096,
        tokenizer_corpus_bytes=4_000_000,
        target=target,
        draft=draft,
        target_train=TrainConfig(budget_s=round(0.72 * budget_s, 1), max_steps=1300, lr=3e-3),
        draft_train=TrainConfig(
            budget_s=round(0.28 * budget_s, 1), max_steps=900, lr=3e-3, teacher_mix=0.5
        ),
        mtp_train=TrainConfig(budget_s=round(0.4 * budget_s, 1), max_steps=400, lr=3e-3, seq=128, batch=8),
        dflash_train=TrainConfig(budget_s=round(0.8 * budget_s, 1), max_steps=700, lr=4e-3, seq=128, batch=8),
    )


def _quick() -> Recipe:
    """The demo's shapes trained for under a minute: what the quick start serves
    first, so its first answer does not wait for the demo pair's training."""
    return replace(_demo(QUICK_BUDGET_S), preset="quick", mtp_train=None, dflash_train=None)


def get_recipe(preset: str) -> Recipe:
    """The recipe for ``preset``; the demo's budget can be scaled via the env."""
    if preset == "test":
        return _test()
    if preset == "quick":
        return _quick()
    if preset == "demo":
        return _demo(float(os.environ.get(BUDGET_ENV, "540")))
    raise ValueError(f"unknown forge preset {preset!r} (choose from {', '.join(PRESETS)})")
