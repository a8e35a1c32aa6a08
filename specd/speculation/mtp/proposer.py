"""MTP proposals: the checkpoint's own head drafts a chain per row.

An MTP head reads the target's features like an EAGLE-1 head (its cache only
ever holds accepted context, fed from the target's prefill and verify
forwards: ``EagleProposer``), but its layer is the family's own decoder
layer, which writes its cache as it attends. So a chain is drafted by
writing: depth j's input (the head's output at depth j - 1, the embedding
of the token it drafted) goes into the head's cache at the next position,
and the k - 1 columns drafted are rolled back when the chain is done, before
the target's verdict feeds the true features in their place. Drafts are the
head's argmax (a point mass for the verifier, lossless at any temperature).
"""

from __future__ import annotations

import mlx.core as mx

from ...core.request import Method
from ..eagle.proposer import EagleProposer
from ..tree import DraftTree


class MTPProposer(EagleProposer):
    method = Method.MTP

    def _expand(self, seqs, drafting: list[bool], depth: int, top_k: int, budget: int,
                chains: list[bool]) -> list[DraftTree | None]:
        """A chain of ``depth`` tokens for each ``drafting`` row of ``seqs`` (every MTP row of the
        batch, so the others catch up too), read back from the device once."""
        outputs = self._catch_up(seqs)  # (B, H): the root's
        cache = self.rows.cache
        tokens = []
        for level in range(depth):
            token = mx.argmax(self.head.logits(outputs, self.lm_head), axis=-1)
            tokens.append(token)
            if level < depth - 1:
                outputs = self.head(outputs[:, None], self.embed(token[:, None]), cache.layers[0])[:, -1]
        if depth > 1:
            cache.rollback([depth - 1] * len(seqs))
        drafted = mx.stack(tokens, axis=1)
        mx.eval(drafted)
        drafted = drafted.tolist()
        return [DraftTree.chain(drafted[b]) if drafting[b] else None for b in range(len(seqs))]
