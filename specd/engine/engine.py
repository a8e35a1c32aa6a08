"""The continuous-batching engine: one thread, one model, many requests.

Every iteration of the engine thread admits waiting requests, runs one bounded
chunk of prompt prefill for newcomers, then one decode step for the running
batch, and hands each request its new tokens.  Requests join and leave the
batch only between steps, so each step is a plain batched forward over
left-padded rows (see ``batch.py``).

The decode step is written as "forward a few tokens per row, choose how many
to keep, roll the rest back" with one token per row, so a proposer and a
multi-token verifier can slot into it without touching the scheduler.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import mlx.core as mx
import mlx.nn as nn
import structlog

from ..metrics import Metrics
from ..spec.config import NO_SPECULATION, SpeculationConfig
from ..spec.speculator import Speculator
from .batch import RunningBatch, make_batch_cache
from .sampling import SamplingParams, sample_rows
from .sequence import GenerationRequest, Sequence, StepOutput, TokenLogprob

log = structlog.get_logger(__name__)


class EngineOverloaded(Exception):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineUnavailable(Exception):
    """The engine is draining or stopped (HTTP 503)."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16
    max_waiting: int = 64
    prefill_step_tokens: int = 512
    max_context: int | None = None


@dataclass
class StepInputs:
    """What reaches the engine thread between two steps."""

    arrivals: list[Sequence]
    cancelled: set[str]
    updates: list[Callable[[], None]]


@dataclass
class _PrefillGroup:
    """Newcomers whose prompts are being prefilled together, chunk by chunk."""

    seqs: list[Sequence]
    tokens: mx.array  # (B, L) left-padded prompts
    cache: list
    done: int = 0


class Engine:
    """Serves one model.  ``generate`` is called from the event loop; all MLX
    work happens on the engine's own thread."""

    def __init__(self, name: str, model: nn.Module, tokenizer, config: EngineConfig = EngineConfig(),
                 metrics: Metrics | None = None, speculation: SpeculationConfig = NO_SPECULATION,
                 draft_model: nn.Module | None = None):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or Metrics()
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.max_context = _model_context(model, config.max_context)
        self._detokenizer = tokenizer.detokenizer
        self.speculator = Speculator(name, model, _vocab_size(model), self.metrics, speculation, draft_model)
        self._updates: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._inbox: deque[Sequence] = deque()
        self._cancelled: set[str] = set()
        self._accepting = True
        self._stopped = False
        self._waiting: deque[Sequence] = deque()
        self._prefill: _PrefillGroup | None = None
        self._batch = RunningBatch()
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    # -- event-loop side -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def in_flight(self) -> int:
        with self._cv:
            return len(self._inbox) + len(self._waiting) + len(self._batch) + (
                len(self._prefill.seqs) if self._prefill else 0)

    def check_prompt(self, request: GenerationRequest) -> None:
        """Raise ValueError if the request can never be served as asked."""
        check_request(request, self.name, self.drafter, self.max_context)

    def submit(self, request: GenerationRequest, emit) -> None:
        """Queue a request; ``emit(StepOutput)`` is called from the engine thread."""
        self.check_prompt(request)
        seq = Sequence(request=request, emit=emit, detokenizer=copy.copy(self._detokenizer),
                       eos_ids=self.eos_ids, max_total_tokens=self.max_context)
        with self._cv:
            if not self._accepting:
                raise EngineUnavailable(f"model {self.name!r} is shutting down")
            if len(self._inbox) + len(self._waiting) >= self.config.max_waiting:
                self.metrics.request_failure.labels(self.name, "overloaded").inc()
                raise EngineOverloaded(
                    f"model {self.name!r} has {self.config.max_waiting} requests waiting; retry later")
            self._inbox.append(seq)
            self._cv.notify()

    @property
    def speculation(self) -> SpeculationConfig:
        """The model's default speculation (its DraftPairing's)."""
        return self.speculator.default

    @property
    def drafter(self) -> str | None:
        """The method of the pairing's drafter ("draft" model, "eagle" head), if one is attached."""
        return self.speculator.drafter

    @property
    def vocab_size(self) -> int:
        return _vocab_size(self.model)

    def speculation_status(self) -> dict:
        """What ``describe`` shows of the model's speculation (read from any thread)."""
        return self.speculator.status()

    def between_steps(self, update: Callable[[], None]) -> None:
        """Run ``update`` on the engine thread before its next step: how
        speculation settings and policies change without a request noticing."""
        with self._cv:
            self._updates.append(update)
            self._cv.notify()

    def configure_speculation(self, default: SpeculationConfig, draft_model: nn.Module | None) -> None:
        self.between_steps(lambda: self.speculator.configure(default, draft_model))

    def set_policy(self, policy, name: str | None) -> None:
        """Swap in the SpecPolicy's controller (None: speculate as requests ask)."""
        self.between_steps(lambda: self.speculator.set_policy(policy, name))

    def cancel(self, request_id: str) -> None:
        """Free a request's batch slot at the next step boundary."""
        with self._cv:
            self._cancelled.add(request_id)
            self._cv.notify()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its outputs; cancels it if the consumer stops early."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.submit(request, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None or out.error is not None
                yield out
        finally:
            if not finished:
                self.cancel(request.request_id)

    async def shutdown(self, grace: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish within ``grace``, then stop."""
        with self._cv:
            self._accepting = False
        deadline = time.monotonic() + grace
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stop()
        await asyncio.to_thread(self._thread.join, 10.0)

    def stop(self) -> None:
        """Stop now: the engine thread leaves after its current step, failing what is left."""
        with self._cv:
            self._accepting = False
            self._stopped = True
            self._cv.notify()

    # -- engine thread ---------------------------------------------------

    def _run(self) -> None:
        while (inputs := self._next_inputs()) is not None:
            self._waiting.extend(inputs.arrivals)
            for update in inputs.updates:
                update()
            try:
                self._step(inputs.cancelled)
            except Exception as exc:  # an engine fault fails its requests, not the daemon
                self._step_failed(exc)
        self._fail_all("engine stopped")

    def _next_inputs(self) -> StepInputs | None:
        """Wait for work; take what arrived since the last step (None: stop)."""
        with self._cv:
            while not (self._inbox or self._cancelled or self._waiting or self._prefill
                       or self._batch or self._stopped or self._updates):
                self._cv.wait()
            if self._stopped:
                return None
            inputs = StepInputs(list(self._inbox), self._cancelled, self._updates)
            self._inbox.clear()
            self._cancelled, self._updates = set(), []
        return inputs

    def _step_failed(self, exc: Exception) -> None:
        log.exception("engine step failed", model=self.name)
        self._fail_all(f"engine error: {exc}")

    def _step(self, cancelled: set[str]) -> None:
        if cancelled:
            self._drop_cancelled(cancelled)
        self._admit()
        self._update_gauges()
        if self._prefill is not None:
            self._prefill_chunk()
        if self._batch:
            self._decode()
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.requests_waiting.labels(self.name).set(len(self._waiting))
        self.metrics.requests_running.labels(self.name).set(
            len(self._batch) + (len(self._prefill.seqs) if self._prefill else 0))

    def _drop_cancelled(self, ids: set[str]) -> None:
        """Requests whose client went away leave now, counted as ``abort`` like vLLM."""
        aborted = [s for s in self._waiting if s.request.request_id in ids]
        self._waiting = deque(s for s in self._waiting if s.request.request_id not in ids)
        if self._prefill is not None:
            for s in self._prefill.seqs:
                if s.request.request_id in ids and not s.cancelled:
                    s.cancelled = True
                    aborted.append(s)
        keep = [i for i, s in enumerate(self._batch.seqs) if s.request.request_id not in ids]
        aborted += [s for s in self._batch.seqs if s.request.request_id in ids]
        self._batch.keep(keep)
        for s in aborted:
            self.metrics.request_success.labels(self.name, "abort").inc()

    def _admit(self) -> None:
        """Start prefilling as many waiting requests as the batch has room for."""
        room = self.config.max_batch_size - len(self._batch)
        if self._prefill is not None or room <= 0 or not self._waiting:
            return
        seqs = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        now = time.monotonic()
        for s in seqs:
            self.metrics.queue_time.labels(self.name).observe(now - s.arrival)
        width = max(len(s.prompt) for s in seqs)
        padding = [width - len(s.prompt) for s in seqs]
        tokens = mx.array([[0] * p + s.prompt for p, s in zip(padding, seqs)])
        self._prefill = _PrefillGroup(seqs, tokens, make_batch_cache(self.model, padding))

    def _prefill_chunk(self) -> None:
        """Run one bounded chunk of the prefill group; on its last chunk the
        group samples its first tokens and joins the running batch."""
        group = self._prefill
        width = group.tokens.shape[1]
        chunk = max(1, self.config.prefill_step_tokens // len(group.seqs))
        end = min(width, group.done + chunk)
        logits = self.model(group.tokens[:, group.done:end], cache=group.cache)
        self.speculator.observe_prefill(group.seqs, group.done, end, [width - len(s.prompt) for s in group.seqs])
        group.done = end
        if end < width:
            mx.eval([c.state for c in group.cache])
            return
        self._prefill = None
        self.metrics.prompt_tokens.labels(self.name).inc(sum(len(s.prompt) for s in group.seqs))
        tokens = self._sample(group.seqs, logits[:, -1, :])
        self._emit(group.seqs, logits[:, -1:, :], [[t] for t in tokens])
        keep = [i for i, s in enumerate(group.seqs) if s.finish_reason is None and not s.cancelled]
        if not keep:
            return
        if len(keep) < len(group.seqs):
            idx = mx.array(keep)
            for layer in group.cache:
                layer.filter(idx)
        self._batch.extend([group.seqs[i] for i in keep], group.cache, [tokens[i] for i in keep])

    def _decode(self) -> None:
        """One decode step: every row forwards its last token plus its proposals
        (none when not speculating); the verifier keeps a prefix of each row's
        proposals and the caches are rolled back to exactly that."""
        batch = self._batch
        step_started = time.perf_counter()
        proposal = self.speculator.propose(batch.seqs, batch.last_tokens, self.max_context)
        width = proposal.width
        if proposal.tree is not None:
            inputs = mx.array(proposal.tree.inputs)
        else:
            inputs = mx.array([[t] + d + [0] * (width - len(d)) for t, d in zip(batch.last_tokens, proposal.drafts)])
        started = time.perf_counter()
        with self.speculator.forward_context(proposal, batch.cache):
            logits = self.model(inputs, cache=batch.cache)
        if width == 0:
            emitted = [[t] for t in self._sample(batch.seqs, logits[:, -1, :])]
            self.speculator.nothing_proposed(batch.seqs, proposal)
        else:
            emitted, logits = self.speculator.verify(batch.seqs, logits, proposal, batch.cache)
        # what a step of this shape costs, verification and rollback included (the controller's input)
        elapsed = time.perf_counter() - started
        self.speculator.observe_step(len(batch), width + 1, elapsed)
        self.speculator.observe_emitted(batch.seqs, emitted)
        self._emit(batch.seqs, logits, emitted)
        self.speculator.observe_outcome(len(batch), time.perf_counter() - step_started)
        batch.last_tokens = [e[-1] for e in emitted]
        batch.keep([i for i, s in enumerate(batch.seqs) if s.finish_reason is None])
        self.speculator.retain(batch.seqs + (self._prefill.seqs if self._prefill is not None else []))

    def _sample(self, seqs: list[Sequence], logits: mx.array) -> list[int]:
        """One token per row from (B, V) logits, with each row's settings and RNG."""
        tokens, keys, _ = sample_rows(logits, [s.params for s in seqs], [s.key for s in seqs])
        mx.eval(tokens, keys)
        for seq, key in zip(seqs, keys):
            seq.key = key
        return tokens.tolist()

    def _emit(self, seqs: list[Sequence], logits: mx.array, emitted: list[list[int]]) -> None:
        """Hand each sequence its new tokens; ``logits[b, j]`` produced ``emitted[b][j]``."""
        reported = _report_logprobs(logits, emitted, [s.params for s in seqs])
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            self._deliver(seq, emitted[i], reported.get(i), now)

    def _deliver(self, seq: Sequence, tokens: list[int], logprobs, now: float) -> None:
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

    def _fail_all(self, message: str) -> None:
        seqs = list(self._waiting) + list(self._batch.seqs)
        if self._prefill is not None:
            seqs += self._prefill.seqs
        with self._cv:
            seqs += list(self._inbox)
            self._inbox.clear()
        self._waiting.clear()
        self._prefill = None
        self._batch = RunningBatch()
        self.speculator.retain([])
        for seq in seqs:
            self.metrics.request_failure.labels(self.name, "engine_error").inc()
            seq.emit(StepOutput(text="", tokens=[], logprobs=None, error=message,
                                prompt_tokens=len(seq.prompt), completion_tokens=len(seq.tokens)))
        self._update_gauges()


def check_request(request: GenerationRequest, model: str, drafter: str | None, max_context: int) -> None:
    """Raise ValueError if the request can never be served as asked."""
    spec = request.speculation
    if spec is not None and spec.method in ("draft", "eagle") and drafter != spec.method:
        what = "draft model" if spec.method == "draft" else "EAGLE head"
        raise ValueError(f"model {model!r} has no {what}; declare a DraftPairing "
                         f"with method: {spec.method}, or ask for ngram")
    if not request.prompt_tokens:
        raise ValueError("prompt is empty")
    if len(request.prompt_tokens) >= max_context:
        raise ValueError(
            f"prompt has {len(request.prompt_tokens)} tokens; this model's context "
            f"window is {max_context} tokens")


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


def _vocab_size(model: nn.Module) -> int:
    return model.args.vocab_size


def _model_context(model: nn.Module, configured: int | None) -> int:
    """The context window: the manifest's limit, else the model's own."""
    args = getattr(model, "args", None)
    native = getattr(args, "max_position_embeddings", None) or 4096
    return min(configured, native) if configured else native
