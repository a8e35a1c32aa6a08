"""DFlash proposals: one forward of the drafter drafts a row's whole block.

The drafter reads the target's features like an EAGLE head (``EagleProposer``
queues them from every prefill chunk and verify step, per sequence), but what
it keeps of them is only its context's keys and values: a position's entries
depend on the target's features there alone (``drafter.py``), so feeding a
row writes them once, they are never rolled back, and the cached entries of a
prefix are keyed by the prefix's tokens. Drafting writes nothing: the block
``[last token, mask, ..]`` at the positions after the context attends to the
context and to itself, and its outputs give the draft distribution of every
position at once. The block is always the drafter's trained size (its
attention is bidirectional: a shorter block would change what each position
sees), and a row's k takes its first k positions.

A chain is each position's argmax; a tree (``topK`` > 1) keeps, depth by
depth, the best candidates by cumulative log-probability, each extended by
the next position's ``topK`` tokens (the positions' distributions do not
depend on one another, so the whole tree comes from the one forward, as in
mlx-vlm's DDTree). Drafts are point masses: lossless at any temperature.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...core.cache import BatchRowCache
from ...core.request import Method
from ...core.sequence import Sequence
from ..eagle.proposer import EagleProposer
from ..proposer import Drafts, Round
from ..tree import DraftTree


class DFlashProposer(EagleProposer):
    method = Method.DFLASH

    @staticmethod
    def entry_keys(tokens: list[int]) -> list[int]:
        """Entry i holds position i's keys and values, which depend on tokens 0..i: keyed by the tokens."""
        return list(tokens)

    def _feed(self, pairs: list[tuple[mx.array, list[int]]], cache: BatchRowCache, left: bool) -> None:
        """Write each row's queued context into every layer, padded on the left (a fresh cache) or
        on the right (rolled back after)."""
        width = max(len(t) for _, t in pairs)
        if not width:
            return None
        # what ``_observe`` queued is already fused into the context's hidden states
        context = mx.stack([mx.pad(f, [(width - len(t), 0) if left else (0, width - len(t)), (0, 0)])
                            for f, t in pairs])
        offset = cache.layers[0].offset
        for layer, (keys, values) in zip(cache.layers, self.head.context_keys_values(context, offset)):
            layer.update_and_fetch(keys, values)
        if not left:
            cache.rollback([width - len(t) for _, t in pairs])
        return None

    def propose(self, round_: Round) -> Drafts:
        drafts = super().propose(round_)
        drafts.shape = (drafts.shape[0], 1)  # one forward drafts the block, whatever its k
        return drafts

    def _expand(self, seqs: list[Sequence], drafting: list[bool], depth: int, top_k: int, budget: int,
                chains: list[bool]) -> list[DraftTree | None]:
        """A chain, or a tree ``depth`` deep of ``budget`` nodes, for each ``drafting`` row of
        ``seqs`` (every DFlash row of the batch, so the others catch up too)."""
        self._catch_up(seqs)
        head, cache = self.head, self.rows.cache
        n = head.block_size
        depth = min(depth, n - 1)
        if not depth:
            return [None] * len(seqs)
        block = mx.array([[s.next_input] + [head.config.mask_token_id] * (n - 1) for s in seqs])
        visible = mx.tril(mx.ones((n, n), dtype=mx.bool_)) if head.config.is_causal else mx.ones((n, n), dtype=mx.bool_)
        ancestry = mx.broadcast_to(visible, (len(seqs), n, n))
        attends = [lambda q, k, v, kv=kv, scale=layer.self_attn.scale: kv.attend_with(q, scale, k, v, ancestry)
                   for kv, layer in zip(cache.layers, head.layers)]
        out = head(self.embed(block), cache.layers[0].offset, attends)[:, 1:depth + 1]
        logits = head.logits(out, self.lm_head).astype(mx.float32)
        if top_k == 1:  # chains: each position's argmax, whatever its probability
            top = mx.argmax(logits, axis=-1, keepdims=True)
            scores = mx.zeros(top.shape)
        else:
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            top = mx.argpartition(-logp, kth=top_k - 1, axis=-1)[..., :top_k]  # (B, depth, top_k)
            scores = mx.take_along_axis(logp, top, axis=-1)
        mx.eval(top, scores)
        top, scores = np.array(top), np.array(scores)
        trees = []
        for b, s in enumerate(seqs):
            if not drafting[b]:
                trees.append(None)
                continue
            candidates = _candidates(top[b], scores[b], top_k)
            trees.append(self._chain(candidates) if chains[b] else self._tree(candidates, budget))
        return trees


def _candidates(top: np.ndarray, scores: np.ndarray, top_k: int) -> list[tuple[int, int, float]]:
    """(token, parent candidate, cumulative log-probability) of a block's expansion: the root's
    children are the first position's ``top_k`` tokens; at every later position the ``top_k`` best
    candidates of the previous one each get that position's ``top_k`` tokens as children."""
    candidates: list[tuple[int, int, float]] = []
    frontier = [(-1, 0.0)]
    for tokens, logps in zip(top.tolist(), scores.tolist()):
        first = len(candidates)
        for parent, score in frontier:
            candidates.extend((t, parent, score + lp) for t, lp in zip(tokens, logps))
        level = range(first, len(candidates))
        frontier = [(c, candidates[c][2]) for c in sorted(level, key=lambda c: -candidates[c][2])[:top_k]]
    return candidates
