"""EAGLE draft heads in MLX (EAGLE-1 and EAGLE-3), laid out like the published checkpoints.

An EAGLE head is one decoder layer that reads the target's hidden state at
position t together with the embedding of token t+1, and predicts the hidden
state at t+1; a language-model head turns that into the draft distribution
of token t+2.  Drafting further feeds the head its own output as the next
hidden state.

* EAGLE-1 (``fc`` over ``[embedding, hidden]`` with bias, ``layers.0`` without
  an input norm, the *target's* LM head on the raw output): the hidden state
  is the target's last, normed one.
* EAGLE-3 (``fc`` fuses three target layers' outputs into one hidden state;
  ``midlayer`` attends over ``[input_layernorm(embedding), hidden_norm(hidden)]``
  (twice the width); ``norm`` and its own ``lm_head`` over a reduced draft
  vocabulary, mapped to target ids by ``d2t``: ``target = draft + d2t[draft]``).

Positions: the head's input for the pair (t, t+1) sits at position t, so after
feeding every known pair a row's cache offset is the length of its context,
and a draft node at depth j (j >= 1) sits at ``offset + j - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ...core.model_parts import rotate_at


@dataclass
class EagleConfig:
    version: int  # 1 or 3
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    head_dim: int | None = None
    draft_vocab_size: int | None = None  # EAGLE-3: reduced vocabulary (default: the target's)
    feature_layers: tuple[int, ...] = field(default_factory=tuple)  # EAGLE-3: fused target layers
    fc_bias: bool = True  # EAGLE-1 checkpoints have one

    def __post_init__(self):
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, not {self.version}")
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        self.feature_layers = tuple(self.feature_layers)
        if self.version == 3 and (len(self.feature_layers) != 3 or list(self.feature_layers) != sorted(
                set(self.feature_layers))):
            raise ValueError("an EAGLE-3 head fuses exactly three distinct target layers, in layer order "
                             f"(feature_layers), not {list(self.feature_layers)}")


class EagleAttention(nn.Module):
    """Attention whose keys are the head's cached context plus, while drafting,
    the draft tree's nodes so far (masked to each node's ancestors)."""

    def __init__(self, config: EagleConfig, in_dims: int):
        super().__init__()
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.n_heads, self.n_kv_heads = heads, kv_heads
        self.scale = dim ** -0.5
        self.q_proj = nn.Linear(in_dims, heads * dim, bias=False)
        self.k_proj = nn.Linear(in_dims, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(in_dims, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=False)
        self.rope = initialize_rope(dim, config.rope_theta, False, config.rope_scaling,
                                    config.max_position_embeddings)

    def project(self, x: mx.array, offset, siblings: bool = False) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values (B, heads, N, D), rotated to positions
        offset, offset + 1, .. (``siblings``: all N to position offset)."""
        B, N, _ = x.shape
        q = self.q_proj(x).reshape(B, N, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, N, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, N, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if siblings:
            at = mx.array(offset).reshape(-1, 1)
            return rotate_at(self.rope, q, at), rotate_at(self.rope, k, at), v
        return self.rope(q, offset=offset), self.rope(k, offset=offset), v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        return self.output(mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask))

    def output(self, attended: mx.array) -> mx.array:
        """The heads' outputs (B, heads, N, D) projected back to the hidden size."""
        B, _, N, _ = attended.shape
        return self.o_proj(attended.transpose(0, 2, 1, 3).reshape(B, N, -1))


class EagleLayer(nn.Module):
    """The head's decoder layer (EAGLE-1 ``layers.0``, EAGLE-3 ``midlayer``)."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.fused = config.version == 3
        self.self_attn = EagleAttention(config, 2 * H if self.fused else H)
        self.mlp = MLP(config)  # reads hidden_size and intermediate_size
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        if self.fused:
            self.hidden_norm = nn.RMSNorm(H, eps=eps)
            self.input_layernorm = nn.RMSNorm(H, eps=eps)

    def finish(self, attended: mx.array, residual: mx.array) -> mx.array:
        h = residual + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    cache_layers = 1  # attention layers in its cache

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        if config.version == 1:
            self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
            self.layers = [EagleLayer(config)]
        else:
            self.fc = nn.Linear(3 * H, H, bias=False)
            self.midlayer = EagleLayer(config)
            self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.d2t = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)

    @property
    def layer(self) -> EagleLayer:
        return self.layers[0] if self.config.version == 1 else self.midlayer

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs it reads (none: the final norm's)."""
        return self.config.feature_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def row_bytes(self) -> int:
        """One position of its cache: keys and values of its one layer."""
        c = self.config
        return 2 * c.num_key_value_heads * c.head_dim * self.layer.self_attn.k_proj.weight.itemsize

    def fuse(self, features: mx.array) -> mx.array:
        """The hidden state the head reads from captured target features
        (EAGLE-3: ``fc`` over the three layers; EAGLE-1: the features as they are)."""
        return self.fc(features) if self.config.version == 3 else features

    def _inputs(self, hidden: mx.array, embeds: mx.array) -> tuple[mx.array, mx.array]:
        """The attention input and the residual for (hidden state, next token's embedding) pairs."""
        if self.config.version == 1:
            x = self.fc(mx.concatenate([embeds, hidden], axis=-1))
            return x, x
        layer = self.midlayer
        return mx.concatenate([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], axis=-1), hidden

    def __call__(self, hidden: mx.array, embeds: mx.array, cache=None) -> mx.array:
        """Feed pairs at the next positions of ``cache`` (a ``RowKV``, left
        padding skipped) or, without one, a causal run from position 0
        (training).  Returns the head's output hidden states."""
        x, residual = self._inputs(hidden, embeds)
        attn = self.layer.self_attn
        if cache is None:
            q, k, v = attn.project(x, 0)
            return self.layer.finish(attn.attend(q, k, v, "causal" if x.shape[1] > 1 else None), residual)
        q, k, v = attn.project(x, cache.offset)
        cache.update_and_fetch(k, v)
        return self.layer.finish(attn.output(cache.attend(q, attn.scale)), residual)

    def draft_step(self, hidden: mx.array, embeds: mx.array, cache, depth: int,
                   nodes: tuple[mx.array, mx.array] | None, ancestry: mx.array) -> tuple[mx.array, tuple]:
        """One depth of a draft tree: ``n`` nodes per row (B, n, H) at depth
        ``depth`` attend to the row's cached context and to their ancestors
        among earlier nodes (``ancestry`` (B, n, nodes so far + n), bool);
        nothing is written to the cache.  Returns outputs and all nodes' keys/values."""
        x, residual = self._inputs(hidden, embeds)
        attn = self.layer.self_attn
        q, k, v = attn.project(x, cache.offset + depth - 1, siblings=True)
        if nodes is not None:
            k, v = mx.concatenate([nodes[0], k], axis=2), mx.concatenate([nodes[1], v], axis=2)
        return self.layer.finish(attn.output(cache.attend_with(q, attn.scale, k, v, ancestry)), residual), (k, v)

    def logits(self, out: mx.array, target_head) -> mx.array:
        """Draft logits over the *target's* vocabulary (EAGLE-3: tokens outside
        the draft vocabulary get -inf)."""
        if self.config.version == 1:
            return target_head(out)
        draft = self.lm_head(self.norm(out))
        ids = mx.arange(self.config.draft_vocab_size) + self.d2t
        full = mx.full((*draft.shape[:-1], self.config.vocab_size), -mx.inf, dtype=draft.dtype)
        full[..., ids] = draft
        return full
