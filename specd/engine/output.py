"""Handing a step's tokens to their requests, as vLLM v1's output processor does.

The runner calls ``deliver`` once a step with each row's new tokens and the logits that
produced them: each sequence takes its tokens (detokenized, stop strings and lengths
checked: ``Sequence.accept``), the serving metrics are counted (time to first token,
inter-token latency, finished requests), OpenAI ``logprobs`` are reported when a request
asked for them, and the request's ``emit`` carries the output to its client.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..core.request import TokenLogprob
from ..core.sampling import SamplingParams
from ..core.sequence import Sequence
from ..metrics import Metrics


class OutputProcessor:
    """A model's outputs to its requests, with the metrics they count."""

    def __init__(self, model_name: str, metrics: Metrics):
        self.name = model_name
        self.metrics = metrics

    def deliver(self, seqs: list[Sequence], logits: mx.array, emitted: list[list[int]]) -> None:
        """Hand each sequence its new tokens; ``logits[b, j]`` produced ``emitted[b][j]``."""
        reported = _report_logprobs(logits, emitted, [s.params for s in seqs])
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            self._emit(seq, emitted[i], reported.get(i), now)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None, now: float) -> None:
        out = seq.accept(tokens, logprobs)
        m, name = self.metrics, self.name
        m.generation_tokens.labels(name).inc(len(out.tokens))
        if seq.first_token_at is None:
            seq.first_token_at = now
            m.time_to_first_token.labels(name).observe(now - seq.arrival)
        else:
            m.inter_token_latency.labels(name).observe((now - seq.last_token_at) / max(1, len(out.tokens)))
        seq.last_token_at = now
        if out.finish_reason is not None:
            m.request_success.labels(name, out.finish_reason).inc()
            m.e2e_latency.labels(name).observe(now - seq.arrival)
            m.request_prompt_tokens.labels(name).observe(len(seq.prompt))
            m.request_generation_tokens.labels(name).observe(len(seq.tokens))
        if not seq.cancelled:
            seq.emit(out)


def _report_logprobs(logits: mx.array, emitted: list[list[int]],
                      params: list[SamplingParams]) -> dict[int, list[TokenLogprob]]:
    """Log-probabilities of the emitted tokens (and the top alternatives) under
    the model's own distribution, as OpenAI's ``logprobs`` reports them."""
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return {}
    raw = logits[mx.array(rows)].astype(mx.float32)
    raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    out: dict[int, list[TokenLogprob]] = {}
    for r, i in enumerate(rows):
        n = params[i].top_logprobs
        items = []
        for j, token in enumerate(emitted[i]):
            row = raw[r, j]
            top: tuple[tuple[int, float], ...] = ()
            if n > 0:
                ids = mx.argsort(-row)[:n]
                top = tuple(zip(ids.tolist(), row[ids].tolist()))
            items.append(TokenLogprob(token, row[token].item(), top))
        out[i] = items
    return out
