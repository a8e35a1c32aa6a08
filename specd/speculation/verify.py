"""Lossless verification of proposed tokens, vectorised over the batch.

One target forward over ``[last, d_1..d_k]`` gives p_1..p_{k+1} for every row.
Greedy rows accept while the target's argmax equals the proposal.  Sampling
rows run speculative sampling (Leviathan et al.; Chen et al.): accept d_j with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
norm(max(0, p_j - q_j)); if all k are accepted draw a bonus token from
p_{k+1}.  The emitted tokens are then distributed exactly as the target's.

Greedy rows need none of those distributions: they are decided on the raw
logits' argmax (no sampling transform moves it).  Only the sampling rows take
the full-vocabulary path, which costs a sizeable part of a small model's step.

Deterministic proposers (n-gram) are the point-mass case q = one_hot(d): the
acceptance probability is p(d) and the residual is p with d removed, which is
still lossless.  Rows may have different proposal lengths (0 included) in the
same call; positions past a row's length are never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..core.sampling import SamplingParams, transform_logprobs


@dataclass
class Verdict:
    accepted: list[int]  # accepted proposals per row
    next_tokens: list[int]  # the correction or bonus token per row


def point_mass(drafts: mx.array, vocab: int) -> mx.array:
    """q for deterministic proposals: one-hot rows over the vocabulary."""
    return (drafts[..., None] == mx.arange(vocab)).astype(mx.float32)


def verify(logits: mx.array, drafts: mx.array, lengths: list[int], params: Sequence[SamplingParams],
           sampled_q: mx.array | None, uniforms: mx.array | None, gumbel: mx.array | None) -> Verdict:
    """Decide, for every row, how many proposals to keep and the token after them.

    logits: (B, K+1, V) the target's raw logits over ``[last, d_1..d_K]``.
    drafts: (B, K) proposed tokens (any value past a row's length).
    lengths: proposals per row, each <= K.
    params: each row's sampling settings; greedy rows are decided by argmax.
    The sampling rows S (in row order) also need sampled_q (S, K, V), their q
    after their own transforms (``point_mass`` for n-gram), and uniforms
    (S, K) and gumbel (S, V) from each row's own RNG stream.
    """
    accepted, next_tokens = accept_argmax(logits, drafts, lengths)
    sampling = [i for i, p in enumerate(params) if not p.greedy]
    if sampling:
        rows = mx.array(sampling)
        target = transform_logprobs(logits[rows], [params[i] for i in sampling])
        accepted[rows], next_tokens[rows] = accept_sampled(
            target, drafts[rows], [lengths[i] for i in sampling], sampled_q, uniforms, gumbel)
    mx.eval(accepted, next_tokens)
    return Verdict(accepted.tolist(), next_tokens.tolist())


def accept_argmax(logits: mx.array, drafts: mx.array, lengths: list[int]) -> tuple[mx.array, mx.array]:
    """Greedy acceptance: the leading proposals that equal the target's argmax,
    and the argmax after them (the correction, or the bonus token)."""
    argmax = mx.argmax(logits, axis=-1)  # (B, K+1)
    K = drafts.shape[1]
    ok = (argmax[:, :K] == drafts) & _valid(lengths, K)
    accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
    return accepted, mx.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]


def accept_sampled(target_logprobs: mx.array, drafts: mx.array, lengths: list[int], draft_probs: mx.array,
                   uniforms: mx.array, gumbel: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling: accepted proposals per row and the token after them.

    target_logprobs: (B, K+1, V) log p after each row's sampling transforms.
    draft_probs: (B, K, V) q after the same transforms.
    uniforms: (B, K) U(0,1) for the acceptance tests; gumbel: (B, V) noise for the final draw.
    """
    B, K1, V = target_logprobs.shape
    K = K1 - 1
    p = mx.exp(target_logprobs)
    if K:
        p_draft = mx.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]
        q_draft = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        ok = (uniforms * q_draft < p_draft) & _valid(lengths, K)  # u < p/q without dividing by q = 0
        accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
    else:
        accepted = mx.zeros((B,), dtype=mx.int32)
    rows = mx.arange(B)
    p_final = p[rows, accepted]
    rejected = accepted < mx.array(lengths)
    if K:
        q_final = draft_probs[rows, mx.minimum(accepted, K - 1)] * rejected[:, None]
        residual = mx.maximum(p_final - q_final, 0.0)
        # p == q at the rejected position cannot be rejected except by rounding; fall back to p.
        residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_final)
    else:
        residual = p_final
    return accepted, mx.argmax(mx.log(residual) + gumbel, axis=-1)


def _valid(lengths: list[int], K: int) -> mx.array:
    """(B, K): positions within each row's proposal."""
    return mx.arange(K)[None, :] < mx.array(lengths)[:, None]
