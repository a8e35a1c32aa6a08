"""Multi-token prediction (MTP) heads: the drafter a checkpoint ships after its last decoder layer.

DeepSeek V3 and V3.2, GLM-4.5 and later (``num_nextn_predict_layers`` in
config.json) keep one more decoder layer, ``model.layers.{num_hidden_layers}``,
trained to predict the token after next: it reads the target's hidden state
at position t (``hnorm``) and the embedding of token t+1 (``enorm``),
projects both to the hidden size (``eh_proj``), runs the family's own
decoder layer (attention over its own cache of earlier positions, then the
MLP or MoE), and the target's LM head after ``shared_head.norm`` gives the
draft distribution of token t+2. mlx-lm drops these weights when it loads a
model (``sanitize``); ``checkpoint.py`` reads them back.

The hidden state it reads is the target's last, normed one (what vLLM and
SGLang hand their MTP layers), so the EAGLE machinery that captures the
target's features (``eagle.capture``) feeds it unchanged. Drafting further
than the checkpoint's depth chains the head: its own output is the next
hidden state, as its layer's output is the next depth's input.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...core.cache import kv_bytes


class MTPHead(nn.Module):
    """One MTP depth: the projection of (hidden state, next token) pairs, the family's decoder layer
    (``layer``, with the checkpoint's MTP weights) and its final norm."""

    feature_layers: tuple[int, ...] = ()  # it reads the target's final, normed hidden state
    cache_layers = 1  # attention layers in its cache

    def __init__(self, layer: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = layer
        self.norm = nn.RMSNorm(hidden_size, eps=eps)  # the checkpoint's ``shared_head.norm``
        self.hidden_size = hidden_size
        self.row_bytes = kv_bytes(_Probe(self))[0]  # one position of its layer's cache (shapes, not weights)

    def fuse(self, features: mx.array) -> mx.array:
        return features

    def __call__(self, hidden: mx.array, embeds: mx.array, cache=None) -> mx.array:
        """Feed (hidden state, next token's embedding) pairs at the next positions of ``cache`` (the
        layer's own, a ``RowKV``, which masks each row itself) or, without one, a causal run from
        position 0 (training); returns the layer's outputs, the next depth's hidden states."""
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        return self.layer(x, "causal" if cache is None and x.shape[1] > 1 else None, cache)

    def logits(self, out: mx.array, target_head) -> mx.array:
        return target_head(self.norm(out))


class _Probe(nn.Module):
    """A head as a one-layer model over token ids, so ``kv_bytes`` reads its cache's width."""

    def __init__(self, head: MTPHead):
        super().__init__()
        self.head = head
        self.layers = [head.layer]

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        x = mx.zeros((*tokens.shape, self.head.hidden_size))
        return self.head(x, x, cache[0])
