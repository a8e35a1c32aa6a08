"""A round's verdict: from its proposals and the target's processed logits to what each row keeps.

The model runner forwards a round's proposals (``[last, d_1..d_k]`` per row,
or every row's draft tree) and hands the logits here: chains are verified by
``verify.verify`` (greedy rows by argmax, sampling rows by speculative
sampling against each row's q), trees by ``tree.accept``. A sampling row's
randomness comes from its own key, so a seeded request samples the same
whatever its batch mates do. The verdict says which of the forward's columns
each row keeps; the runner rolls the caches back to exactly those.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..core.sampling import transform_logprobs
from ..core.sequence import Sequence
from .proposer import Outcome, Proposal
from .tree import accept
from .verify import point_mass, verify


@dataclass
class Verification:
    outcome: Outcome  # per row: proposals accepted, tokens emitted, the forward's columns kept
    logits: mx.array  # logits[b, j] produced outcome.emitted[b][j]
    drop: np.ndarray  # (B, W): the forward's columns each row forgets


def verify_round(seqs: list[Sequence], logits: mx.array, proposal: Proposal, vocab: int) -> Verification:
    """Keep each row's accepted proposals plus one target token."""
    if proposal.tree is not None:
        return _verify_tree(seqs, logits, proposal, vocab)
    width = proposal.width
    padded = mx.array([d + [0] * (width - len(d)) for d in proposal.drafts])
    sampling = [i for i, s in enumerate(seqs) if not s.params.greedy]
    lengths = [len(d) for d in proposal.drafts]
    q = uniforms = gumbel = None
    if sampling:  # only sampling rows need q and randomness
        drafted_q = _draft_q(proposal, width, vocab)
        q = mx.stack([drafted_q[i] if i in drafted_q else point_mass(padded[i], vocab) for i in sampling])
        forced = proposal.forced_only
        uniforms, gumbel = randomness([seqs[i] for i in sampling], width, [lengths[i] for i in sampling],
                                      [forced[i] for i in sampling], vocab)
    verdict = verify(logits, padded, lengths, [s.params for s in seqs], q, uniforms, gumbel)
    emitted = [d[:a] + [t] for d, a, t in zip(proposal.drafts, verdict.accepted, verdict.next_tokens)]
    kept = [list(range(len(e))) for e in emitted]
    drop = np.arange(width + 1)[None, :] > np.array(verdict.accepted)[:, None]
    return Verification(Outcome(verdict.accepted, emitted, kept), logits, drop)


def _draft_q(proposal: Proposal, width: int, vocab: int) -> dict[int, mx.array]:
    """Each draft-model row's q over ``width`` proposal columns: the
    draft's own for the tokens it drafted, a point mass for those a
    grammar forced, and anything past the row's proposal."""
    out = {}
    for i, q in proposal.offered.q.items():
        chain = proposal.drafts[i]
        drafted = len(chain) - (proposal.forced[i] if proposal.forced is not None else 0)
        point = point_mass(mx.array(chain[drafted:] + [0] * (width - len(chain))), vocab)
        out[i] = mx.concatenate([q[:drafted], point]) if drafted else point
    return out


def _verify_tree(seqs: list[Sequence], logits: mx.array, proposal: Proposal, vocab: int) -> Verification:
    """The tree path: walk every row's tree, keep the accepted path's columns."""
    tree, trees = proposal.tree, proposal.trees
    params = [s.params for s in seqs]
    target = transform_logprobs(logits, params)
    uniforms, gumbel = randomness(seqs, tree.width, [len(t.tokens) for t in trees], proposal.forced_only, vocab)
    verdict = accept(target, trees, tree, [p.greedy for p in params], uniforms, gumbel,
                     _draft_q(proposal, tree.width - 1, vocab))
    kept = [[0] + [tree.columns[b][n] for n in path] for b, path in enumerate(verdict.paths)]
    drop = np.ones((len(seqs), tree.width), dtype=bool)
    for b, cols in enumerate(kept):
        drop[b, cols] = False
    emitted = [[t.tokens[n] for n in path] + [nxt] for t, path, nxt in zip(trees, verdict.paths, verdict.next_tokens)]
    width = max(len(c) for c in kept)
    columns = mx.array([c + [0] * (width - len(c)) for c in kept])
    return Verification(Outcome([len(p) for p in verdict.paths], emitted, kept),
                        mx.take_along_axis(logits, columns[..., None], axis=1), drop)


def randomness(seqs: list[Sequence], width: int, proposed: list[int], forced_only: list[int],
               vocab: int) -> tuple[mx.array, mx.array]:
    """Acceptance uniforms and final-draw noise from each sampling row's own
    key.  A row that proposed nothing draws its token with the noise a
    plain step's sampler would use, so a seeded request samples the same
    whether its batch mates speculate or not.  A row that proposed only
    tokens its grammar forced (``forced_only``: accepted with certainty)
    first advances its key once per forced token, as the plain steps that
    would have produced them do: how many forced tokens a round carries
    is the cost model's choice, from measured step times, and must not
    change what a seeded request samples.  Greedy rows get zeros."""
    sampling = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not sampling:
        return mx.zeros((len(seqs), width)), mx.zeros((len(seqs), vocab))
    for i in sampling:
        for _ in range(forced_only[i]):
            seqs[i].key, _ = mx.random.split(seqs[i].key)
    drafted = mx.array([bool(proposed[i]) and proposed[i] != forced_only[i] for i in sampling])
    keys, drawn, noise = _round_draws(width, vocab)(mx.stack([seqs[i].key for i in sampling]), drafted)
    for j, i in enumerate(sampling):
        seqs[i].key = keys[j]
    if len(sampling) == len(seqs):
        return drawn, noise
    rows = mx.array(sampling)
    uniforms, gumbel = mx.zeros((len(seqs), width)), mx.zeros((len(seqs), vocab))
    uniforms[rows] = drawn
    gumbel[rows] = noise
    return uniforms, gumbel


@functools.lru_cache(maxsize=None)
def _round_draws(width: int, vocab: int) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]:
    """Stacked keys (S, 2) and whether each row drafted (S,) -> each key advanced by one split,
    and from the other half of it: a drafting row's acceptance uniforms and final-draw noise
    (from the two halves of a second split), or zeros and a plain step's noise. One vectorised
    call for every sampling row (``mx.vmap``), the same numbers as a loop over the rows."""
    def one_row(key: mx.array, drafted: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        key, sub = mx.random.split(key)
        k_u, k_g = mx.random.split(sub)
        drawn = mx.where(drafted, mx.random.uniform(shape=(width,), key=k_u), 0.0)
        return key, drawn, mx.random.gumbel(shape=(vocab,), key=mx.where(drafted, k_g, sub))
    return mx.vmap(one_row)
