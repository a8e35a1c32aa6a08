"""Where mlx-lm's model families keep their parts.

Speculation reads a target's hidden states and reuses its embedding and LM
head (EAGLE), and rotates draft-tree tokens in its attention layers; the
families name and nest these differently (multimodal checkpoints nest the
text model in ``language_model``, Mamba-style ones call it ``backbone``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

# Where mlx-lm's families keep their parts: the decoder stack (multimodal
# checkpoints nest it in ``language_model``; Mamba-style ones call it
# ``backbone``), its token embedding and its final norm.
DECODER_PATHS = ("model", "language_model.model", "backbone")
EMBEDDING_NAMES = ("embed_tokens", "embeddings")
FINAL_NORM_NAMES = ("norm", "norm_f", "final_layernorm", "embedding_norm")


def decoder(model: nn.Module) -> nn.Module:
    """The module that holds the target's decoder ``layers``, its token
    embedding and its final norm, whatever the family calls them."""
    for path in DECODER_PATHS:
        inner = model
        for name in path.split("."):
            inner = getattr(inner, name, None)
        if isinstance(getattr(inner, "layers", None), list):
            return inner
    raise ValueError(f"{type(model).__module__}: no decoder stack at {', '.join(DECODER_PATHS)}")


def _child(module: nn.Module, names: tuple[str, ...], what: str) -> nn.Module:
    found = next((getattr(module, n) for n in names if getattr(module, n, None) is not None), None)
    if found is None:
        raise ValueError(f"{type(module).__module__}: no {what} among {', '.join(names)}")
    return found


def final_norm(model: nn.Module) -> nn.Module:
    """The norm whose output the LM head reads (EAGLE-1's feature)."""
    return _child(decoder(model), FINAL_NORM_NAMES, "final norm")


def target_parts(model: nn.Module) -> tuple[nn.Module, object]:
    """The target's token embedding and LM head (tied embeddings included)."""
    embed = _child(decoder(model), EMBEDDING_NAMES, "token embedding")
    for owner in (model, getattr(model, "language_model", None)):
        if getattr(owner, "lm_head", None) is not None:
            return embed, owner.lm_head
    return embed, embed.as_linear


def rotate_at(rope: Callable[..., mx.array], x: mx.array, positions: mx.array) -> mx.array:
    """Rotate x (B, heads, n, D) so that token j of row b sits at
    ``positions[b, j]``: every token becomes its own length-1 sequence with
    its own offset, in one RoPE call."""
    B, H, n, D = x.shape
    positions = mx.broadcast_to(positions, (B, n)).reshape(-1)
    y = rope(x.transpose(0, 2, 1, 3).reshape(B * n, H, 1, D), offset=positions)
    return y.reshape(B, n, H, D).transpose(0, 2, 1, 3)
