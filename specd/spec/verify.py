"""Lossless verification of proposed tokens, vectorised over the batch.

One target forward over ``[last, d_1..d_k]`` gives p_1..p_{k+1} for every row.
Greedy rows accept while the target's argmax equals the proposal.  Sampling
rows run speculative sampling (Leviathan et al.; Chen et al.): accept d_j with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
norm(max(0, p_j - q_j)); if all k are accepted draw a bonus token from
p_{k+1}.  The emitted tokens are then distributed exactly as the target's.

Deterministic proposers (n-gram) are the point-mass case q = one_hot(d): the
acceptance probability is p(d) and the residual is p with d removed, which is
still lossless.  Rows may have different proposal lengths (0 included) in the
same call; positions past a row's length are never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Verdict:
    accepted: list[int]  # accepted proposals per row
    next_tokens: list[int]  # the correction or bonus token per row


def point_mass(drafts: mx.array, vocab: int) -> mx.array:
    """q for deterministic proposals: one-hot rows over the vocabulary."""
    return (drafts[..., None] == mx.arange(vocab)).astype(mx.float32)


def verify(target_logprobs: mx.array, drafts: mx.array, lengths: list[int], draft_probs: mx.array,
           greedy: list[bool], uniforms: mx.array, gumbel: mx.array) -> Verdict:
    """Decide, for every row, how many proposals to keep and the token after them.

    target_logprobs: (B, K+1, V) log p after each row's sampling transforms.
    drafts: (B, K) proposed tokens (any value past a row's length).
    lengths: proposals per row, each <= K.
    draft_probs: (B, K, V) q after the same transforms (``point_mass`` for n-gram).
    greedy: rows decided by argmax instead of sampling.
    uniforms: (B, K) U(0,1) for the acceptance tests; gumbel: (B, V) noise for
    the final draw.  Both come from each row's own RNG stream.
    """
    B, K1, V = target_logprobs.shape
    K = K1 - 1
    p = mx.exp(target_logprobs)
    is_greedy = mx.array(greedy)[:, None]
    valid = mx.arange(K)[None, :] < mx.array(lengths)[:, None]
    if K:
        p_draft = mx.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]
        q_draft = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        sampled_ok = uniforms * q_draft < p_draft  # u < p/q without dividing by q = 0
        greedy_ok = mx.argmax(target_logprobs[:, :K], axis=-1) == drafts
        ok = mx.where(is_greedy, greedy_ok, sampled_ok) & valid
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
    sampled = mx.argmax(mx.log(residual) + gumbel, axis=-1)
    greedy_token = mx.argmax(p_final, axis=-1)
    next_tokens = mx.where(is_greedy[:, 0], greedy_token, sampled)
    mx.eval(accepted, next_tokens)
    return Verdict(accepted.tolist(), next_tokens.tolist())
