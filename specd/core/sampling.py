"""Per-request sampling, vectorised over the running batch.

mlx-lm's samplers take one scalar setting for the whole batch; a continuous
batch mixes requests with different temperatures and truncations, so the same
maths (temperature, then top-k, top-p and min-p masks on log-probabilities) is
applied here with one parameter per row.  The speculative verifier applies this
exact transform to both the target and the draft distributions, which is what
keeps speculative sampling lossless.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

NEG_INF = -float("inf")


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler.  temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit), OpenAI's logit_bias
    presence_penalty: float = 0.0  # subtracted once from every token the completion already holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the completion
    repetition_penalty: float = 1.0  # divides (or, if negative, multiplies) logits of tokens seen in prompt or completion

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _column(values: Sequence[float], dtype=mx.float32) -> mx.array:
    return mx.array(list(values), dtype=dtype)[:, None]


def adjust_logits(logits: mx.array, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                  completions: Sequence[Sequence[int]], inputs: mx.array | None = None,
                  ancestry: mx.array | None = None) -> mx.array:
    """The target's (B, L, V) logits as each request asks to sample from them:
    ``logit_bias`` added, and presence, frequency and repetition penalties
    applied with the context each position sees.

    Row b has generated ``completions[b]`` after ``prompts[b]``.  In a verify
    forward over ``inputs`` (B, L), position j also saw the proposals
    ``ancestry[b, j]`` marks (a chain: those before and at j; a tree: j's
    ancestors), column 0 being the completion's last token.  Applied before
    anything reads the logits, so a speculating row is decided by exactly
    the distribution a plain one would be.
    """
    if not any(p.logit_bias or p.penalized for p in params):
        return logits
    B, L, V = logits.shape
    x = logits.astype(mx.float32)
    entries = [(b, token, value) for b, p in enumerate(params) for token, value in p.logit_bias]
    if entries:
        rows, tokens, values = zip(*entries)
        bias = mx.zeros((B, V)).at[mx.array(rows), mx.array(tokens)].add(mx.array(values, dtype=mx.float32))
        x = x + bias[:, None, :]
    rows = [b for b, p in enumerate(params) if p.penalized]
    if not rows:
        return x
    counts = mx.zeros((len(rows), V))
    seen = mx.zeros((len(rows), V))
    for r, b in enumerate(rows):
        context = list(prompts[b]) + list(completions[b])
        if completions[b]:
            counts[r] = counts[r].at[mx.array(list(completions[b]))].add(1.0)
        if context:
            seen[r] = seen[r].at[mx.array(context)].add(1.0)
    counts = mx.broadcast_to(counts[:, None, :], (len(rows), L, V))
    seen = mx.broadcast_to(seen[:, None, :], (len(rows), L, V))
    if inputs is not None and L > 1:
        marks = mx.tril(mx.ones((L, L))) if ancestry is None else ancestry.astype(mx.float32)
        marks = mx.broadcast_to(marks, (B, L, L))[mx.array(rows)] * (mx.arange(L) > 0)  # column 0 is counted
        proposed = marks @ (inputs[mx.array(rows)][..., None] == mx.arange(V)).astype(mx.float32)
        counts, seen = counts + proposed, seen + proposed
    chosen = [params[b] for b in rows]
    presence = mx.array([p.presence_penalty for p in chosen])[:, None, None]
    frequency = mx.array([p.frequency_penalty for p in chosen])[:, None, None]
    repetition = mx.array([p.repetition_penalty for p in chosen])[:, None, None]
    y = x[mx.array(rows)]
    y = mx.where(seen > 0, mx.where(y > 0, y / repetition, y * repetition), y)
    y = y - presence * (counts > 0) - frequency * counts
    x[mx.array(rows)] = y
    return x


def transform_logprobs(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """Log-probabilities of the distribution each row samples from.

    ``logits`` is (B, V) or (B, L, V); row b uses ``params[b]``.  Greedy rows
    are left at temperature 1 (their argmax is unchanged by any of the masks).
    """
    squeeze = logits.ndim == 2
    x = logits[:, None, :] if squeeze else logits
    x = x.astype(mx.float32)
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        x = x / _column(temps)[:, :, None]
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if any(p.truncates for p in params):
        logprobs = _truncate(logprobs, params)
    return logprobs[:, 0, :] if squeeze else logprobs


def _truncate(logprobs: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """Apply per-row top-k, top-p and min-p, then renormalise."""
    vocab = logprobs.shape[-1]
    keep = mx.ones(logprobs.shape, dtype=mx.bool_)
    sorted_lp = mx.sort(logprobs, axis=-1)[..., ::-1]  # descending
    if any(p.top_k > 0 for p in params):
        k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        kth = mx.take_along_axis(sorted_lp, (_column(k, mx.int32) - 1)[:, :, None], axis=-1)
        keep = keep & (logprobs >= kth)
    if any(p.top_p < 1.0 for p in params):
        top_p = _column([p.top_p for p in params])[:, :, None]
        probs = mx.exp(sorted_lp)
        mass_before = mx.cumsum(probs, axis=-1) - probs
        # Number of leading tokens needed to reach top_p (at least one).
        n_keep = mx.maximum((mass_before < top_p).sum(axis=-1, keepdims=True), 1)
        threshold = mx.take_along_axis(sorted_lp, n_keep - 1, axis=-1)
        keep = keep & (logprobs >= threshold)
    if any(p.min_p > 0.0 for p in params):
        log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else NEG_INF for p in params])
        keep = keep & (logprobs >= sorted_lp[..., :1] + log_min_p[:, :, None])
    masked = mx.where(keep, logprobs, NEG_INF)
    return masked - mx.logsumexp(masked, axis=-1, keepdims=True)


def make_key(seed: int | None) -> mx.array:
    """A request's own RNG stream, so its samples do not depend on batch mates."""
    return mx.random.key(secrets.randbits(63) if seed is None else seed)


def sample_rows(
    logits: mx.array, params: Sequence[SamplingParams], keys: list[mx.array]
) -> tuple[mx.array, list[mx.array], mx.array | None]:
    """Sample one token per row of raw (B, V) ``logits``, each row with its own settings and RNG.

    Greedy rows take the argmax of the logits as they are (no transform moves
    it), so they cost no full-vocabulary work (a draft model pays it at every
    drafted position).  Sampling rows draw from their transformed
    distribution by Gumbel-max, each consuming one split of its own key, so
    a seeded request draws the same numbers alone or batched.
    Returns the tokens (B,), the advanced keys, and the sampling rows'
    log-probabilities (S, V), in row order (None without any): a draft
    model's q.
    """
    tokens = mx.argmax(logits, axis=-1)
    keys = list(keys)
    sampling = [i for i, p in enumerate(params) if not p.greedy]
    if not sampling:
        return tokens, keys, None
    rows = mx.array(sampling)
    logprobs = transform_logprobs(logits[rows], [params[i] for i in sampling])
    advanced, noise = _gumbel_rows(logits.shape[-1])(mx.stack([keys[i] for i in sampling]))
    for j, i in enumerate(sampling):
        keys[i] = advanced[j]
    tokens[rows] = mx.argmax(logprobs + noise, axis=-1)
    return tokens, keys, logprobs


@functools.lru_cache(maxsize=None)
def _gumbel_rows(vocab: int) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """Stacked keys (S, 2) -> each advanced by one split, and a Gumbel draw over the vocabulary
    from the other half of that split: one vectorised call for every sampling row (``mx.vmap``),
    the same numbers as a loop over the rows, which cost the host its Python and a few graph
    nodes per row at every step."""
    def one_row(key: mx.array) -> tuple[mx.array, mx.array]:
        key, sub = mx.random.split(key)
        return key, mx.random.gumbel(shape=(vocab,), key=sub)
    return mx.vmap(one_row)
