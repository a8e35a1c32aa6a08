"""Per-row sampling transforms and the stop-string matcher."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from specd.core.sampling import SamplingParams, make_key, sample_rows, transform_logprobs
from specd.core.sequence import StopMatcher

LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=np.float32))


def probs(params: SamplingParams) -> np.ndarray:
    lp = transform_logprobs(mx.array(LOGITS[None]), [params])
    return np.exp(np.array(lp[0]))


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(), [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
    (SamplingParams(top_k=2), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
    (SamplingParams(top_p=0.7), [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0, 0]),
    (SamplingParams(top_p=0.65), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
    (SamplingParams(min_p=0.3), [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0, 0]),
    (SamplingParams(top_p=0.01), [1, 0, 0, 0, 0, 0]),
])
def test_truncations_match_reference(params, expected):
    np.testing.assert_allclose(probs(params), expected, atol=1e-6)


def test_temperature_sharpens():
    p = probs(SamplingParams(temperature=0.5))
    ref = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]) ** 2
    np.testing.assert_allclose(p, ref / ref.sum(), atol=1e-6)


def test_rows_use_their_own_parameters():
    rows = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(temperature=2.0, top_p=0.5)]
    lp = np.exp(np.array(transform_logprobs(mx.array(np.stack([LOGITS] * 3)), rows)))
    np.testing.assert_allclose(lp[0], probs(rows[0]), atol=1e-6)
    np.testing.assert_allclose(lp[1], probs(rows[1]), atol=1e-6)
    np.testing.assert_allclose(lp[2], probs(rows[2]), atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5)])
def test_sampled_frequencies_follow_the_distribution(params):
    """Pearson chi-square over the kept bins: 20.5 and 18.5 are the 0.999
    quantiles at 5 and 4 dof.  Raw logits go in: the row's transform is applied inside."""
    keys = [make_key(7)]
    logits = mx.array(LOGITS[None] + 3.0)  # unnormalised
    n = 4000
    counts = np.zeros(6)
    for _ in range(n):
        tok, keys, _ = sample_rows(logits, [params], keys)
        counts[tok.item()] += 1
    p = probs(params)
    kept = p > 0
    assert counts[~kept].sum() == 0
    expected = n * p[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < {5: 20.5, 4: 18.5}[int(kept.sum()) - 1], (counts, expected)


def test_each_row_draws_what_it_would_draw_alone():
    """Sampling rows draw their noise in one vectorised call: each row's token and advanced key
    are still exactly those of the same row sampled alone, over steps, with greedy rows between."""
    rng = np.random.default_rng(3)
    vocab, rows = 257, 6
    params = [SamplingParams(temperature=0) if i % 3 == 1 else SamplingParams(temperature=0.5 + i / 4, top_p=0.9)
              for i in range(rows)]
    batched = [make_key(i) for i in range(rows)]
    alone = list(batched)
    for _ in range(3):
        logits = mx.array(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
        tokens, batched, _ = sample_rows(logits, params, batched)
        for i in range(rows):
            token, (alone[i],), _ = sample_rows(logits[i:i + 1], [params[i]], [alone[i]])
            assert token.item() == tokens[i].item()
            assert np.array_equal(np.array(alone[i]), np.array(batched[i]))


def test_greedy_rows_ignore_noise_and_keep_their_key():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1, seed=1)]
    keys = [make_key(1), make_key(1)]
    tokens, new_keys, logprobs = sample_rows(mx.array(np.stack([LOGITS[::-1], LOGITS])), params, keys)
    assert tokens.tolist()[0] == 5
    assert logprobs.shape == (1, 6)  # the sampling row's distribution only
    assert np.array_equal(np.array(new_keys[0]), np.array(keys[0]))
    assert not np.array_equal(np.array(new_keys[1]), np.array(keys[1]))


def test_stop_matcher_spans_chunks_and_holds_back_prefixes():
    m = StopMatcher(("STOP",))
    assert m.feed("hello S") == ("hello ", False)
    assert m.feed("TO") == ("", False)
    assert m.feed("P and more") == ("", True)


def test_stop_matcher_releases_false_alarm():
    m = StopMatcher(("<end>",))
    assert m.feed("a <en") == ("a ", False)
    assert m.feed("try") == ("<entry", False)
    assert m.flush() == ""
    m.feed("x <e")
    assert m.flush() == "<e"


def test_stop_matcher_earliest_of_several():
    m = StopMatcher(("cd", "b"))
    assert m.feed("abcd") == ("a", True)
