"""Draft trees: layout, and lossless acceptance at T > 0 on known distributions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from specd.speculation.tree import DraftTree, accept, layout

V = 6
ROWS = 30000


def test_layout_groups_columns_by_depth_and_masks_to_ancestors():
    trees = [DraftTree([4, 5, 1, 2], [-1, -1, 0, 0]), DraftTree.chain([3, 3, 3])]
    tree = layout(trees, [9, 8])
    assert tree.depths == [0, 1, 1, 2, 2, 3]
    assert tree.inputs == [[9, 4, 5, 1, 2, 0], [8, 3, 0, 3, 0, 3]]
    assert tree.columns == [[1, 2, 3, 4], [1, 3, 5]]
    # node 1 (token 2, column 4) sees the root, its parent (column 1) and itself, not its sibling branch
    assert tree.ancestry[0, 4].tolist() == [True, True, False, False, True, False]
    assert tree.ancestry[1, 5].tolist() == [True, True, False, True, False, True]
    assert DraftTree([4, 5, 1, 2], [-1, -1, 0, 0]).pruned(1) == DraftTree([4, 5], [-1, -1])


def _dist(rng: np.random.Generator) -> np.ndarray:
    p = rng.dirichlet(np.ones(V) * 0.7)
    return p


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * np.abs(counts / counts.sum() - p).sum()


def test_tree_acceptance_at_temperature_keeps_the_target_distribution():
    """Every row verifies the same tree (root children 0, 1, 2; node 0 has
    children 3, 4) against the same target distributions with its own
    randomness.  The first emitted token must follow p_root, and the second,
    given the first was the tree's node 0, p_node0 — whatever the tree proposed."""
    rng = np.random.default_rng(0)
    p_root, p_node0 = _dist(rng), _dist(rng)
    tree = DraftTree([0, 1, 2, 3, 4], [-1, -1, -1, 0, 0])
    lay = layout([tree], [5])
    W = lay.width
    probs = np.tile(_dist(rng), (W, 1))
    probs[0], probs[lay.columns[0][0]] = p_root, p_node0
    logp = mx.broadcast_to(mx.log(mx.array(probs, dtype=mx.float32)), (ROWS, W, V))
    key = mx.random.key(1)
    k_u, k_g = mx.random.split(key)
    verdict = accept(logp, [tree] * ROWS, layout([tree] * ROWS, [5] * ROWS), [False] * ROWS,
                     mx.random.uniform(shape=(ROWS, W), key=k_u), mx.random.gumbel(shape=(ROWS, V), key=k_g), {})
    emitted = [[tree.tokens[n] for n in path] + [t] for path, t in zip(verdict.paths, verdict.next_tokens)]
    first = np.bincount([e[0] for e in emitted], minlength=V)
    second = np.bincount([e[1] for e, path in zip(emitted, verdict.paths) if path and path[0] == 0], minlength=V)
    assert _tv(first, p_root) < 0.015
    assert second.sum() > 3000 and _tv(second, p_node0) < 0.03
    assert sum(1 for p in verdict.paths if p) / ROWS == pytest.approx(p_root[:3].sum(), abs=0.015)


def test_a_draft_model_chain_in_a_tree_batch_keeps_the_target_distribution():
    """A chain sampled from a draft's q is verified with min(1, p/q) and the max(0, p - q) residual."""
    rng = np.random.default_rng(1)
    p, q = _dist(rng), _dist(rng)
    drafts = rng.choice(V, size=ROWS, p=q)
    trees = [DraftTree.chain([int(d)]) for d in drafts]
    lay = layout(trees, [0] * ROWS)
    logp = mx.broadcast_to(mx.log(mx.array(np.stack([p, p]), dtype=mx.float32)), (ROWS, 2, V))
    k_u, k_g = mx.random.split(mx.random.key(2))
    q_rows = mx.array(q[None], dtype=mx.float32)
    verdict = accept(logp, trees, lay, [False] * ROWS, mx.random.uniform(shape=(ROWS, 2), key=k_u),
                     mx.random.gumbel(shape=(ROWS, V), key=k_g), {b: q_rows for b in range(ROWS)})
    first = np.bincount([trees[b].tokens[0] if path else t for b, (path, t) in
                         enumerate(zip(verdict.paths, verdict.next_tokens))], minlength=V)
    assert _tv(first, p) < 0.015
    assert sum(1 for x in verdict.paths if x) / ROWS == pytest.approx(np.minimum(p, q).sum(), abs=0.015)


def test_greedy_rows_follow_the_argmax_branch():
    tree = DraftTree([1, 2, 3], [-1, -1, 1])
    lay = layout([tree], [0])
    probs = np.full((lay.width, V), 0.01)
    probs[0, 2] = 1.0  # the root's argmax is the second child
    probs[lay.columns[0][1], 3] = 1.0  # then its child
    probs[lay.columns[0][2], 5] = 1.0  # and the bonus after it
    logp = mx.log(mx.array(probs / probs.sum(-1, keepdims=True), dtype=mx.float32))[None]
    verdict = accept(logp, [tree], lay, [True], mx.zeros((1, lay.width)), mx.zeros((1, V)), {})
    assert verdict.paths == [[1, 2]] and verdict.next_tokens == [5]


def test_a_tree_forward_gives_every_path_the_logits_of_decoding_it_alone(forged):
    """Random trees over a batch of left-padded rows, several steps in a row
    (so earlier steps' dropped nodes are holes in the cache): each kept path's
    logits equal a plain forward over that row's context and path."""
    import random

    from mlx_lm import load

    from specd.core.cache import make_row_cache
    from specd.speculation.tree import TreePositions, verifying

    target, _ = load(str(forged / "target"))
    positions = TreePositions(target)
    rng = random.Random(0)

    def random_tree(n: int) -> DraftTree:
        depth = []
        tokens, parents = [], []
        for i in range(n):
            parent = rng.choice([-1] + [j for j in range(i) if depth[j] < 3])
            depth.append(1 if parent < 0 else depth[parent] + 1)
            tokens.append(rng.randrange(3, 1000))
            parents.append(parent)
        order = sorted(range(n), key=lambda i: (depth[i], i))
        index = {o: k for k, o in enumerate(order)}
        return DraftTree([tokens[o] for o in order], [index[parents[o]] if parents[o] >= 0 else -1 for o in order])

    prompts = [[rng.randrange(3, 1000) for _ in range(5 + 3 * b)] for b in range(3)]
    width = max(map(len, prompts))
    cache = make_row_cache(target, [width - len(p) for p in prompts])
    target(mx.array([[0] * (width - len(p)) + p for p in prompts]), cache=cache.layers)
    context = [list(p) for p in prompts]
    last = [rng.randrange(3, 1000) for _ in prompts]
    for _ in range(8):
        trees = [random_tree(rng.randrange(0, 7)) for _ in prompts]
        tree = layout(trees, last)
        with verifying(positions, cache, tree):
            logits = target(mx.array(tree.inputs), cache=cache.layers)
        drop = np.ones((len(prompts), tree.width), dtype=bool)
        for b, t in enumerate(trees):
            node, path = -1, []
            while (kids := [i for i, p in enumerate(t.parents) if p == node]) and rng.random() < 0.8:
                node = rng.choice(kids)
                path.append(node)
            columns = [0] + [tree.columns[b][n] for n in path]
            alone = target(mx.array([context[b] + [last[b]] + [t.tokens[n] for n in path]]))[0, -len(columns):]
            assert mx.abs(alone - logits[b, mx.array(columns)]).max().item() < 1e-4
            drop[b, columns] = False
            context[b] += [last[b]] + [t.tokens[n] for n in path]
            last[b] = rng.randrange(3, 1000)
        cache.forget(drop)
