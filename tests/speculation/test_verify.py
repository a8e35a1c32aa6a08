"""Speculative sampling is lossless: statistical tests on known distributions.

Context-free p and q make every emitted token i.i.d. from the target p, so the
verifier's output can be compared with p directly: the first emitted token of
each round, every emitted token pooled, and consecutive pairs of the stream the
rounds form.  Pearson chi-square with
fixed seeds; thresholds are the 0.999 quantiles, so a correct verifier fails
about once in a thousand seeds and a biased one fails at these sample sizes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from specd.core.sampling import SamplingParams, transform_logprobs
from specd.speculation.verify import accept_sampled, point_mass, verify

GREEDY = SamplingParams(temperature=0)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 35: 66.62}
N = 20000
K = 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    expected = counts.sum() * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def run_verifier(p_logits: np.ndarray, q_logits: np.ndarray | None, params: SamplingParams,
                 seed: int, fixed_draft: int | None = None):
    """N independent rows; returns accepted counts, drafts and next tokens."""
    rng = np.random.default_rng(seed)
    V = p_logits.shape[-1]
    logp = transform_logprobs(mx.array(np.broadcast_to(p_logits, (N, K + 1, V)).copy()), [params] * N)
    if q_logits is None:
        drafts = np.full((N, K), fixed_draft)
        q = point_mass(mx.array(drafts), V)
    else:
        logq = transform_logprobs(mx.array(np.broadcast_to(q_logits, (N, K, V)).copy()), [params] * N)
        qn = np.exp(np.array(logq[0, 0], dtype=np.float64))
        drafts = rng.choice(V, size=(N, K), p=qn / qn.sum())
        q = mx.exp(logq)
    key_u, key_g = mx.random.split(mx.random.key(seed))
    accepted, next_tokens = accept_sampled(logp, mx.array(drafts), [K] * N, q, mx.random.uniform(shape=(N, K), key=key_u),
                                           mx.random.gumbel(shape=(N, V), key=key_g))
    target = np.exp(np.array(logp[0, 0], dtype=np.float64))
    return np.array(accepted), drafts, np.array(next_tokens), target


def emitted_rows(accepted, drafts, next_tokens):
    return [list(d[:a]) + [t] for a, d, t in zip(accepted, drafts, next_tokens)]


P = np.log(np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]))
Q_CLOSE = np.log(np.array([0.30, 0.30, 0.15, 0.10, 0.10, 0.05]))
Q_ADVERSARIAL = np.log(np.array([0.01, 0.01, 0.02, 0.06, 0.3, 0.6]))


@pytest.mark.parametrize("name,q,params,seed", [
    ("close", Q_CLOSE, SamplingParams(), 1),
    ("adversarial", Q_ADVERSARIAL, SamplingParams(), 2),
    ("temperature", Q_ADVERSARIAL, SamplingParams(temperature=0.6), 3),
    ("top_k", Q_CLOSE, SamplingParams(top_k=4), 4),
    ("top_p", Q_ADVERSARIAL, SamplingParams(top_p=0.8), 5),
    ("min_p", Q_CLOSE, SamplingParams(min_p=0.3, temperature=1.3), 6),
])
def test_draft_model_acceptance_follows_target(name, q, params, seed):
    accepted, drafts, nxt, target = run_verifier(P, q, params, seed)
    rows = emitted_rows(accepted, drafts, nxt)
    V = len(P)
    first = np.bincount([r[0] for r in rows], minlength=V)
    stat, dof = chi2(first, target)
    assert stat < CHI2_999[dof], (name, first, target)
    pooled = np.bincount([t for r in rows for t in r], minlength=V)
    stat, dof = chi2(pooled, target)
    assert stat < CHI2_999[dof], (name, pooled, target)
    if target.min() > 0:  # the rounds, concatenated, are one i.i.d. stream from p
        stream = np.array([t for r in rows for t in r])
        pairs = np.bincount(stream[:-1:2] * V + stream[1::2], minlength=V * V)
        stat, dof = chi2(pairs, np.outer(target, target).ravel())
        assert stat < CHI2_999[dof], name
    if name == "adversarial":  # q far from p: most proposals must be rejected
        assert accepted.mean() < 0.5


@pytest.mark.parametrize("draft,seed", [(0, 7), (5, 8)])
def test_point_mass_proposals_are_lossless(draft, seed):
    accepted, drafts, nxt, target = run_verifier(P, None, SamplingParams(), seed, fixed_draft=draft)
    rows = emitted_rows(accepted, drafts, nxt)
    first = np.bincount([r[0] for r in rows], minlength=len(P))
    stat, dof = chi2(first, target)
    assert stat < CHI2_999[dof], (first, target)
    assert abs(accepted.astype(bool).mean() - target[draft]) < 4 * np.sqrt(target[draft] / N)


def test_greedy_accepts_exactly_the_argmax_prefix():
    V = 5
    logits = np.full((2, 4, V), -3.0, dtype=np.float32)
    for pos, tok in enumerate([2, 4, 1, 3]):
        logits[:, pos, tok] = 3.0
    drafts = mx.array([[2, 4, 0], [2, 4, 1]])
    v = verify(mx.array(logits), drafts, [3, 3], [GREEDY] * 2, None, None, None)  # greedy rows need no q
    assert v.accepted == [2, 3] and v.next_tokens == [1, 3]
    v = verify(mx.array(logits), drafts, [1, 0], [GREEDY] * 2, None, None, None)
    assert v.accepted == [1, 0] and v.next_tokens == [4, 2]


def test_greedy_and_sampling_rows_are_decided_alike_alone_and_mixed():
    """A sampling row's verdict does not depend on greedy rows beside it, nor the other way round."""
    V, K = 6, 3
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(size=(3, K + 1, V)).astype(np.float32))
    drafts = mx.array(rng.integers(0, V, size=(3, K)))
    params = [GREEDY, SamplingParams(temperature=0.8), GREEDY]
    q = point_mass(drafts[1:2], V)
    u, g = mx.random.uniform(shape=(1, K), key=mx.random.key(5)), mx.random.gumbel(shape=(1, V), key=mx.random.key(6))
    mixed = verify(logits, drafts, [3, 2, 1], params, q, u, g)
    alone = verify(logits[1:2], drafts[1:2], [2], params[1:2], q, u, g)
    greedy = verify(logits[::2], drafts[::2], [3, 1], [GREEDY] * 2, None, None, None)
    assert mixed.accepted[1] == alone.accepted[0] and mixed.next_tokens[1] == alone.next_tokens[0]
    assert mixed.accepted[::2] == greedy.accepted and mixed.next_tokens[::2] == greedy.next_tokens


def test_rows_with_different_lengths_never_accept_past_their_length():
    V = 4
    logits = mx.zeros((3, 4, V))  # uniform p: sampled rows accept point masses w.p. 1/4
    drafts = mx.array([[1, 1, 1], [2, 2, 2], [3, 3, 3]])
    v = verify(logits, drafts, [0, 1, 3], [SamplingParams()] * 3, point_mass(drafts, V),
               mx.zeros((3, 3)), mx.zeros((3, V)))  # u = 0 accepts everything allowed
    assert v.accepted == [0, 1, 3]


def test_a_rounds_randomness_is_each_rows_own_whatever_its_batch_mates():
    """The round's draws are made for every sampling row in one vectorised call: each row's
    uniforms, noise and advanced key are still what the same row draws alone, one split per
    forced token first, then a plain step's noise where it drafted nothing (or only forced
    tokens), uniforms and noise from a second split where it drafted; greedy rows get zeros
    and keep their keys."""
    from types import SimpleNamespace

    from specd.core.sampling import make_key
    from specd.speculation.verifier import randomness

    width, vocab = 4, 50
    rows = [(SamplingParams(temperature=0.7), 3, 0), (SamplingParams(temperature=0), 2, 0),
            (SamplingParams(temperature=1.0), 0, 0), (SamplingParams(temperature=0.9), 2, 2),
            (SamplingParams(temperature=1.2), 3, 1)]

    def batch():
        return [SimpleNamespace(params=p, key=make_key(40 + i)) for i, (p, _, _) in enumerate(rows)]
    together = batch()
    uniforms, gumbel = randomness(together, width, [n for _, n, _ in rows], [f for _, _, f in rows], vocab)
    for i, (seq, (params, proposed, forced)) in enumerate(zip(batch(), rows)):
        u, g = randomness([seq], width, [proposed], [forced], vocab)
        assert np.array_equal(np.array(u[0]), np.array(uniforms[i])), i
        assert np.array_equal(np.array(g[0]), np.array(gumbel[i])), i
        assert np.array_equal(np.array(seq.key), np.array(together[i].key)), i
        # and the draws are what the documented splits give
        key = make_key(40 + i)
        if params.greedy:
            assert not np.any(np.array(u)) and not np.any(np.array(g))
            assert np.array_equal(np.array(seq.key), np.array(key))
            continue
        for _ in range(forced):
            key, _ = mx.random.split(key)
        key, sub = mx.random.split(key)
        assert np.array_equal(np.array(seq.key), np.array(key))
        if proposed and proposed != forced:
            k_u, k_g = mx.random.split(sub)
            assert np.array_equal(np.array(u[0]), np.array(mx.random.uniform(shape=(width,), key=k_u)))
            assert np.array_equal(np.array(g[0]), np.array(mx.random.gumbel(shape=(vocab,), key=k_g)))
        else:
            assert not np.any(np.array(u))
            assert np.array_equal(np.array(g[0]), np.array(mx.random.gumbel(shape=(vocab,), key=sub)))
