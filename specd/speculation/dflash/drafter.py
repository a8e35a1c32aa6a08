"""DFlash block drafters (z-lab, arXiv 2602.06036), laid out like the published checkpoints.

A DFlash drafter drafts a whole block in one forward. Its input is the block
``[last token, mask, mask, ..]`` (the target's own embedding of each, the
mask token's too) at the positions that follow the context; its output at
block position j is the draft distribution of the token j places after the
last one, through the target's LM head. The block attends to itself in both
directions (``is_causal`` false, the published default) and to the context.

The context is the target's own: the outputs of a few of its decoder layers
(``target_layer_ids``), concatenated and projected (``fc``, ``hidden_norm``)
into one hidden state per position. Every drafter layer projects that same
state into its keys and values (it never runs through the layers), so a
position's entries depend on the target's features there alone, are written
once when the target has kept the position, and are never rolled back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

# attention of a block's queries over its context and its own keys and values: (q, k, v) -> heads' outputs
Attend = Callable[[mx.array, mx.array, mx.array], mx.array]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    is_causal: bool = False  # within the block
    num_target_layers: int | None = None  # the target's decoder layers, as the checkpoint records them


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * dim, c.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dim, eps=c.rms_norm_eps)
        self.rope = initialize_rope(dim, c.rope_theta, False, c.rope_scaling, c.max_position_embeddings)

    def _heads(self, x: mx.array, proj: nn.Linear, n: int, norm: nn.RMSNorm | None) -> mx.array:
        B, N, _ = x.shape
        out = proj(x).reshape(B, N, n, -1)
        return (norm(out) if norm is not None else out).transpose(0, 2, 1, 3)

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """Keys and values (B, kv heads, N, D) of ``x`` at positions ``offset`` (per row) onwards."""
        keys = self.rope(self._heads(x, self.k_proj, self.n_kv_heads, self.k_norm), offset=offset)
        return keys, self._heads(x, self.v_proj, self.n_kv_heads, None)

    def __call__(self, x: mx.array, offset, attend: Attend) -> mx.array:
        queries = self.rope(self._heads(x, self.q_proj, self.n_heads, self.q_norm), offset=offset)
        keys, values = self.keys_values(x, offset)
        out = attend(queries, keys, values)
        B, _, N, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def __call__(self, x: mx.array, offset, attend: Attend) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), offset, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter's own weights; the embedding and the LM head are the target's."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DFlashLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs it reads, in layer order."""
        return self.config.target_layer_ids

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def cache_layers(self) -> int:
        """Attention layers in its cache: one per drafter layer."""
        return self.config.num_hidden_layers

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def row_bytes(self) -> int:
        """One context position of its cache: keys and values in every layer."""
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.fc.weight.itemsize

    def fuse(self, features: mx.array) -> mx.array:
        """The context's hidden states from the captured target features (B, N, layers x H)."""
        return self.hidden_norm(self.fc(features))

    def context_keys_values(self, context: mx.array, offset) -> list[tuple[mx.array, mx.array]]:
        """Every layer's keys and values of fused ``context`` states at positions ``offset`` onwards."""
        return [layer.self_attn.keys_values(context, offset) for layer in self.layers]

    def __call__(self, block: mx.array, offset, attends: list[Attend]) -> mx.array:
        """The normed outputs (B, N, H) of block embeddings ``block`` at positions ``offset`` (per
        row) onwards, layer i attending through ``attends[i]``."""
        h = block
        for layer, attend in zip(self.layers, attends):
            h = layer(h, offset, attend)
        return self.norm(h)

    def logits(self, out: mx.array, target_head) -> mx.array:
        return target_head(out)
