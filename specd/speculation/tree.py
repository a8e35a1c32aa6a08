"""Draft trees: one target forward verifies every branch, lossless at any temperature.

A proposer may offer a row a tree of candidate continuations instead of one
chain (EAGLE-2's dynamic trees).  The engine then forwards, for every row, the
last token (the root) and all nodes at once: columns are laid out by depth,
the same depth groups for every row (a row short of nodes at some depth gets
idle columns), every column is rotated to position ``offset + depth`` with
the model's own RoPE (``TreePositions``), and the cache's mask lets every node
see the context and its own ancestors only.

Acceptance walks each row down from the root.  Greedy rows follow the child
equal to the target's argmax.  Sampling rows try the children in turn as
point-mass proposals: child c is accepted with probability p'(c), where p' is
the target's distribution with the children already rejected removed and
renormalised; if all are rejected the next token is drawn from that residual
(multi-candidate speculative sampling without replacement, each step of which
is an ordinary lossless speculative-sampling step, so the emitted tokens are
distributed exactly as the target's).  A chain from a draft model (one child
per node, with its q) uses the usual min(1, p/q) test and max(0, p - q)
residual.  Only the accepted path's columns stay in the KV cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.cache import RowCache
from ..core.model_parts import decoder, rotate_at
from .hooks import hook


@dataclass
class DraftTree:
    """Nodes in depth order; ``parents[i]`` is an earlier node's index, or -1 for the root."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def pruned(self, depth: int) -> "DraftTree":
        """The nodes at most ``depth`` deep (nodes come in depth order, so parents stay first)."""
        keep = [i for i, d in enumerate(self.depths()) if d <= depth]
        index = {n: i for i, n in enumerate(keep)}
        return DraftTree([self.tokens[n] for n in keep], [index.get(self.parents[n], -1) for n in keep])

    def depths(self) -> list[int]:
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth


@dataclass
class TreeLayout:
    """Where every row's root and nodes sit in the verify forward."""

    inputs: list[list[int]]  # (B, W) tokens
    columns: list[list[int]]  # per row: column of each node (the root is column 0)
    ancestry: np.ndarray  # (B, W, W) column j is column i's ancestor or itself
    depths: list[int]  # (W,) every row's column j is this deep (the root: 0)

    @property
    def width(self) -> int:
        return len(self.inputs[0])


def layout(trees: list[DraftTree], last_tokens: list[int]) -> TreeLayout:
    """Lay rows out by depth: depth d gets as many columns as the row with most nodes there."""
    depths = [t.depths() for t in trees]
    deepest = max((max(d, default=0) for d in depths), default=0)
    counts = [1] + [max(d.count(level) for d in depths) for level in range(1, deepest + 1)]
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    width = starts[-1]
    B = len(trees)
    inputs = [[0] * width for _ in range(B)]
    ancestry = np.zeros((B, width, width), dtype=bool)
    ancestry[:, np.arange(width), np.arange(width)] = True  # idle columns see only themselves
    columns = []
    for b, (tree, depth) in enumerate(zip(trees, depths)):
        inputs[b][0] = last_tokens[b]
        used = list(starts[:-1])
        cols = []
        for token, parent, d in zip(tree.tokens, tree.parents, depth):
            col = used[d]
            used[d] += 1
            cols.append(col)
            inputs[b][col] = token
            parent_col = 0 if parent < 0 else cols[parent]
            ancestry[b, col] = ancestry[b, parent_col]
            ancestry[b, col, col] = True
        columns.append(cols)
    depth_of = [d for d, n in enumerate(counts) for _ in range(n)]
    return TreeLayout(inputs, columns, ancestry, depth_of)


class TreePositions:
    """Per-token RoPE positions for a model whose attention rotates with
    ``self.rope(x, offset=cache.offset)`` (mlx-lm's models): while a layout
    is set, column j of every row is rotated to ``offset + depth(j)``.
    Installed by hooking each rope module (``hooks.hook``), like the feature
    capture; a later ``TreePositions`` of the same model takes them over."""

    def __init__(self, model: nn.Module):
        self.depths: mx.array | None = None  # (W,) depth of each verify column
        for layer in decoder(model).layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not hasattr(attn, "rope"):
                raise ValueError(f"{type(layer).__name__} has no self_attn.rope: draft trees need one")
            hook(attn.rope, self._rotate)

    def _rotate(self, rope: Callable[..., mx.array], x: mx.array, offset=0) -> mx.array:
        """A rope module's call: as its own unless a layout is set."""
        if self.depths is None:
            return rope(x, offset=offset)
        return rotate_at(rope, x, mx.array(offset).reshape(-1, 1) + self.depths)


@contextmanager
def verifying(positions: TreePositions, cache: RowCache, tree: TreeLayout) -> Iterator[None]:
    """The model's next forward over ``cache`` verifies ``tree``."""
    positions.depths = mx.array(tree.depths)
    try:
        with cache.tree_attention(mx.array(tree.ancestry)):
            yield
    finally:
        positions.depths = None


@dataclass
class TreeVerdict:
    paths: list[list[int]]  # accepted node indices per row, root to leaf
    next_tokens: list[int]


def accept(logprobs: mx.array, trees: list[DraftTree], tree: TreeLayout, greedy: list[bool],
           uniforms: mx.array, gumbel: mx.array, draft_q: dict[int, mx.array]) -> TreeVerdict:
    """Walk every row's tree (see the module docstring).

    logprobs: (B, W, V) the target's log p after each row's sampling transforms.
    uniforms: (B, W) and gumbel: (B, V), from each row's own RNG stream.
    draft_q: rows whose chain came from a draft model -> (K, V) its q per depth.
    """
    B = len(trees)
    rows, cols, toks = [], [], []
    for b, t in enumerate(trees):
        for parent, token in zip(t.parents, t.tokens):
            rows.append(b)
            cols.append(0 if parent < 0 else tree.columns[b][parent])
            toks.append(token)
    p = mx.exp(logprobs)
    argmax = mx.argmax(logprobs, axis=-1)
    p_child = p[mx.array(rows), mx.array(cols), mx.array(toks)] if rows else mx.zeros((0,))
    q_child = {b: mx.take_along_axis(q[: len(trees[b].tokens)], mx.array(trees[b].tokens)[:, None], axis=-1)[:, 0]
               for b, q in draft_q.items()}
    mx.eval(argmax, p_child, uniforms, *q_child.values())
    argmax, p_child, u = argmax.tolist(), p_child.tolist(), uniforms.tolist()
    q_child = {b: q.tolist() for b, q in q_child.items()}

    paths, final_cols, removed, q_depth = [], [], [], {}
    at = 0
    for b, t in enumerate(trees):
        p_of = p_child[at: at + len(t.tokens)]  # by node
        at += len(t.tokens)
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(t.parents):
            children.setdefault(parent, []).append(i)
        node, col, path, used, gone = -1, 0, [], 0, []
        while children.get(node):
            gone, chosen = [], None
            for c in children[node]:
                if greedy[b]:
                    ok = t.tokens[c] == argmax[b][col]
                elif b in draft_q:
                    ok = u[b][used] * q_child[b][c] < p_of[c]
                    used += 1
                else:
                    ok = u[b][used] * (1.0 - sum(p_of[g] for g in gone)) < p_of[c]
                    used += 1
                if ok:
                    chosen = c
                    break
                gone.append(c)
            if chosen is None:
                break
            node, col = chosen, tree.columns[b][chosen]
            path.append(chosen)
            gone = []
        paths.append(path)
        final_cols.append(col)
        removed.append([t.tokens[g] for g in gone])
        if gone and b in draft_q:
            q_depth[b] = len(path)
    p_final = p[mx.arange(B), mx.array(final_cols)]
    residual = p_final
    drop = np.zeros(p_final.shape, dtype=bool)
    for b, tokens in enumerate(removed):
        if b not in q_depth:
            drop[b, tokens] = True
    residual = mx.where(mx.array(drop), 0.0, residual)
    for b, depth in q_depth.items():
        residual[b] = mx.maximum(p_final[b] - draft_q[b][depth], 0.0)
    # a residual that rounding emptied falls back to p
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_final)
    sampled = mx.argmax(mx.log(residual) + gumbel, axis=-1)
    greedy_token = mx.argmax(p_final, axis=-1)
    next_tokens = mx.where(mx.array(greedy), greedy_token, sampled)
    return TreeVerdict(paths, next_tokens.tolist())
