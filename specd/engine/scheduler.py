"""The continuous-batching scheduler: one model, many requests, one step at a time.

Every step the scheduler admits waiting requests, plans one bounded chunk of
prompt prefill for newcomers (``PrefillChunk``), then one decode step for the
running batch (``DecodeStep``: its rows, and how many tokens each proposes,
the speculation controller's k), and the model runner (``runner.py``)
executes each plan: forwards, samples or verifies, rolls back. The scheduler
then hands each request its new tokens. Requests join and leave the batch
only between steps; who they are is the scheduler's decision, what a row
runs is the runner's.

The scheduler is driven by a thread that owns it: a local ``Engine``, or a
rank of a tensor-parallel group, which feeds every rank the same inputs.
"""

from __future__ import annotations

import copy
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import structlog

from ..core.batch import RunningBatch
from ..core.cache import kv_bytes, make_row_cache, padding_leaks
from ..core.columns import KVQuantization
from ..core.loader import context_window, vocab_size, weight_bytes
from ..core.memory import host_memory_bytes
from ..core.prefix import PrefixStore, default_max_bytes, model_prefixes
from ..core.prefix_disk import DiskConfig, DiskPrefixes, DiskTier, namespace
from ..core.grammar import Constraint, grammar_tokenizer
from ..core.request import GenerationRequest, StepOutput
from ..core.sequence import Sequence
from ..core.vision import VisionTower
from ..metrics import Metrics
from ..core.request import DRAFTERS, Method, SpeculationConfig
from ..speculation.speculator import Speculator
from .kv_manager import ROUND_GROWTH, KVManager, default_max_bytes as default_kv_bytes
from .memory_guard import OUT_OF_MEMORY, MemoryGuard
from .plan import ChunkSizes, DecodeStep, PrefillGroup
from .output import OutputProcessor
from .runner import ModelRunner

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32  # as many rows as mlx_lm.server decodes together by default
    max_waiting: int = 64
    prefill_step_tokens: int = 512  # a prefill chunk's tokens while rows decode (each waits for it between tokens)
    prefill_alone_tokens: int = 2048  # ... and while none does, at least (mlx-lm's prefill_step_size)
    max_context: int | None = None
    prefix_cache_bytes: int | None = None  # None: a tenth of the host's memory; 0: off
    kv_cache_bytes: int | None = None  # None: kv_manager.default_max_bytes
    kv_bits: int | None = None  # the target's keys and values stored quantized (4 or 8), or not
    kv_group_size: int = 64
    host_memory: int | None = None  # what the default KV budget is a share of (None: this host's)
    # near MLX's memory limit the prefix cache gives way and requests wait (``memory_guard.py``): off
    # where ranks must decide alike (tensor parallelism), each reading its own process's memory
    watch_memory_limit: bool = True
    decode_ahead: bool | None = None  # plain steps start the next before reading their tokens (None: the default)
    prefix_disk: DiskConfig | None = None  # the prefix cache's disk tier (None: RAM only)


@dataclass
class StepInputs:
    """What reaches the scheduler between two steps."""

    arrivals: list[Sequence] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    updates: list[Callable[[], None]] = field(default_factory=list)


class Scheduler:
    """The engine thread's state: waiting requests, the prefill group and the running batch."""

    def __init__(self, name: str, model: nn.Module, tokenizer, config: EngineConfig, metrics: Metrics,
                 speculation: SpeculationConfig, drafter: nn.Module | None, vision: VisionTower | None = None):
        self.kv_quantization = KVQuantization(config.kv_bits, config.kv_group_size) if config.kv_bits else None
        try:
            self.prefill_rows_alone = warm_up(model, self.kv_quantization)  # left padding would change its rows
        except ValueError as exc:
            if self.kv_quantization is None:
                raise
            raise ValueError(f"kvCache.bits {config.kv_bits} with kvCache.groupSize {config.kv_group_size} "
                             f"does not fit this model's attention heads: {exc}") from exc
        self.name = name
        self.model = model
        self.config = config
        self.metrics = metrics
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        native = context_window(model, tokenizer)
        self.max_context = min(config.max_context, native) if config.max_context else native
        self.vocab_size = vocab_size(model)
        budget = default_max_bytes() if config.prefix_cache_bytes is None else config.prefix_cache_bytes
        self.memory = MemoryGuard() if config.watch_memory_limit else None
        self.prefix_store = PrefixStore(budget, self.memory.short if self.memory is not None else None)
        metrics.prefix_cache_max_bytes.labels(name).set(budget)
        self.prefixes = model_prefixes(model, self.prefix_store, "target")
        self.wake: Callable[[], None] = lambda: None  # the engine's: step soon (a disk read ended)
        self.disk = self._disk_tier(config.prefix_disk)
        stateful = self.prefixes.tree is not None and self.prefixes.tree.stateful
        self.chunks = ChunkSizes(config.prefill_step_tokens, config.prefill_alone_tokens, stateful,
                                 self.disk.block if self.disk is not None and stateful else None)
        self.speculator = Speculator(name, model, self.vocab_size, self.max_context, metrics, self.prefix_store,
                                     speculation, drafter)
        ahead = config.decode_ahead if config.decode_ahead is not None else decodes_ahead_by_default()
        self.runner = ModelRunner(name, model, self.speculator, metrics, lambda: self.max_context, ahead, vision)
        self.native_context = self.max_context
        self.kv = KVManager(0, kv_bytes(model, self.kv_quantization), self.speculator.drafter_row_bytes())
        self.kv.max_bytes = config.kv_cache_bytes if config.kv_cache_bytes is not None else default_kv_bytes(
            config.host_memory or host_memory_bytes(), weight_bytes(model), self.kv, config.max_batch_size, self.native_context)
        self._fit_context()
        metrics.kv_cache_max_bytes.labels(name).set(self.kv.max_bytes)
        self._detokenizer = tokenizer.detokenizer
        self.output = OutputProcessor(name, metrics)
        self.tokenizer = tokenizer
        self.waiting: deque[Sequence] = deque()
        # every sequence made here, weakly: a fault in the middle of moving some between the queue,
        # a prefill group and the batch (admission, say) leaves them in none, and ``fail_all`` still ends them
        self.made: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self.prefill: PrefillGroup | None = None
        self.batch = RunningBatch()

    def _disk_tier(self, config: DiskConfig | None) -> DiskPrefixes | None:
        """The target tree's disk tier, in a namespace of the checkpoint and the KV quantization."""
        if config is None or self.prefixes.tree is None:
            return None
        q = self.kv_quantization
        space = namespace(config.identity, (q.bits, q.group_size) if q else None, "target")
        name, metrics = self.name, self.metrics
        metrics.prefix_disk_max_bytes.labels(name).set(config.max_bytes)
        tier = DiskTier(config, space, self.prefixes.tree.stateful,
                        on_change=lambda tier: metrics.prefix_disk_status(name, tier.status()))
        metrics.prefix_disk_status(name, tier.status(), fresh=True)
        disk = DiskPrefixes(tier, self.prefixes.tree, len(self.prefixes.windows), lambda: self.wake(),
                            lambda tier, hits, seconds: metrics.prefix_disk_restore_seconds.labels(name).observe(seconds))
        self.prefixes.disk = disk
        return disk

    def prefix_status(self) -> dict:
        """The prefix cache's budget, bytes and hits, and its disk tier's."""
        status = self.prefix_store.status()
        if self.disk is not None:
            status["disk"] = self.disk.tier.status()
        return status

    def close(self) -> None:
        """The engine stopped: queued blocks are written, the RAM tree is freed."""
        if self.disk is not None:
            self.disk.close()
        self.prefix_store.clear()

    def sequence(self, request: GenerationRequest, emit: Callable[[StepOutput], None]) -> Sequence:
        constraint = None
        if request.grammar is not None:
            tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
            constraint = Constraint(request.grammar, tokenizer, self.eos_ids)
        seq = Sequence(request=request, emit=emit, detokenizer=copy.copy(self._detokenizer),
                       eos_ids=self.eos_ids, max_total_tokens=self.max_context, constraint=constraint)
        self.made.add(seq)
        return seq

    def configure_speculation(self, default: SpeculationConfig, drafter: nn.Module | None) -> None:
        """Attach, change or detach the pairing; the drafter's rows count against the KV budget."""
        self.speculator.configure(default, drafter)
        self.kv.drafter = self.speculator.drafter_row_bytes()
        self._fit_context()

    def _fit_context(self) -> None:
        """The context is what the model's window and the KV budget both hold."""
        self.max_context = self.speculator.max_context = min(self.native_context, self.kv.max_tokens)

    @property
    def context_reason(self) -> str:
        """Why ``max_context`` is below the model's window, when the KV budget is the reason."""
        if self.max_context >= self.native_context:
            return ""
        return (f" (its KV budget, kvCache.maxBytes {self.kv.max_bytes} bytes at {self.kv.token_bytes} "
                f"bytes a token, holds {self.max_context} of its {self.native_context})")

    @property
    def busy(self) -> bool:
        """Whether a step has work: a request waiting only for its disk read does not (the read's
        end wakes the engine)."""
        return bool(self.prefill or self.batch
                    or any(self.disk is None or not self.disk.reading(s) for s in self.waiting))

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.batch) + (len(self.prefill.seqs) if self.prefill else 0)

    def step(self, inputs: StepInputs) -> None:
        self.waiting.extend(inputs.arrivals)
        for update in inputs.updates:
            update()
        if inputs.cancelled:
            self._drop_cancelled(inputs.cancelled)
        self._admit()
        self._update_gauges()
        chunk = self.chunks.next_chunk(self.prefill, bool(self.batch))
        if chunk is not None:
            self.runner.prefill(chunk)
            chunk.group.done = chunk.end
            self._record_prefill(chunk.group, chunk.end)
        if self.prefill is not None and self.prefill.done == self.prefill.width:
            self._join(self.prefill)
        if self.batch:
            self._make_room()
            round_ = self.speculator.plan(self.batch.seqs, self.batch.last_tokens)
            self.runner.decode(DecodeStep(self.batch, round_), self.output.deliver)
            self._leave(self._keep(lambda s: s.finish_reason is None))
            if not self.batch:
                self.runner.drop_ahead()
        self._update_gauges()
        self._measure_kv()

    def fail_all(self, message: str, also: list[Sequence] | None = None) -> None:
        """End every request (and ``also``, arrivals not yet stepped) with ``message``: those queued,
        prefilling or decoding, and any other not ended that a fault caught between them."""
        seqs = list(self.waiting) + list(self.batch.seqs) + (self.prefill.seqs if self.prefill else []) + (also or [])
        listed = set(seqs)
        seqs += [s for s in list(self.made) if not s.ended and s not in listed]
        self.waiting.clear()
        self.prefill = None
        self.batch = RunningBatch()
        self.runner.drop_ahead()
        try:
            self._leave(seqs)
        except Exception:  # whatever releasing them broke, the requests still end, never hang
            log.exception("releasing failed requests failed", model=self.name)
        for seq in seqs:
            self.metrics.request_failure.labels(self.name, "engine_error").inc()
            seq.emit(seq.failed(message))
        self._update_gauges()
        self._measure_kv()

    def _leave(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.prefixes.release(seq)
        if seqs:
            self.speculator.release(seqs)

    def _keep(self, stays: Callable[[Sequence], bool]) -> list[Sequence]:
        """Rows that go leave the batch; what their caches hold is recorded first."""
        for b, seq in enumerate(self.batch.seqs):
            if not stays(seq):
                self._record_row(b, seq)
        return self.batch.keep([i for i, s in enumerate(self.batch.seqs) if stays(s)])

    def _record_row(self, b: int, seq: Sequence) -> None:
        """Record a leaving row's prompt and completion in the prefix cache.
        Its cache holds every token but the last it produced; when the
        request ended inside a round, it holds more than the request kept,
        and its recurrent state is past what can be named."""
        self.prefixes.record(seq, seq.context_keys, len(seq.prompt) + seq.produced - 1, self.batch.cache, b,
                             prompt=len(seq.prompt))

    def _rows(self) -> list[tuple[int, int]]:
        """Per running row, then per row still prefilling: its tokens, and how many of them
        it reads in place from the prefix cache (held there, under that budget)."""
        rows = [(s.context_length, self.batch.cache.shared_tokens(b)) for b, s in enumerate(self.batch.seqs)]
        if self.prefill is None:
            return rows
        return rows + [(len(c), self.prefill.cache.shared_tokens(b)) for b, c in enumerate(self.prefill.contexts)]

    def _own_tokens(self) -> list[int]:
        """Per row, the tokens it holds itself."""
        return [tokens - shared for tokens, shared in self._rows()]

    def _make_room(self) -> None:
        """Preempt the rows that joined last until every row, and every row
        still prefilling, fits the KV budget after this round, and MLX is within its
        memory limit (``memory_guard.py``); one row always stays. What the budget has
        left beyond them may pad the rows in a block layout."""
        own = self._own_tokens()
        while len(self.batch) > 1 and not self.kv.fits(own):
            self._preempt(len(self.batch) - 1)
            self.kv.preemptions += 1
            self.metrics.kv_preemptions.labels(self.name).inc()
            own = self._own_tokens()
        while self.memory is not None and len(self.batch) > 1 and self.memory.over():
            self._preempt(len(self.batch) - 1)
            self.metrics.memory_preemptions.labels(self.name).inc()
            own = self._own_tokens()
        room = self.kv.room(own)
        self.batch.cache.allow_padding(room)
        self.speculator.allow_padding(room)

    def _preempt(self, b: int) -> None:
        """Row b leaves the batch to be recomputed later: what it holds is recorded in the
        prefix cache (resuming restores it; not while MLX is short of memory), and its request
        goes back to the front of the queue."""
        seq = self.batch.seqs[b]
        self._record_row(b, seq)
        self.runner.withdraw(seq)
        self.batch.keep([i for i in range(len(self.batch)) if i != b])
        self._leave([seq])
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def _measure_kv(self) -> None:
        """What the rows' caches hold at the end of a step (a walk over every row's buffers: once a step)."""
        held = (self.batch.cache.nbytes if self.batch.cache is not None else 0) + self.speculator.drafter_cache_bytes()
        self.kv.held(held + (self.prefill.cache.nbytes if self.prefill else 0),
                     sum(shared for _, shared in self._rows()))
        self.metrics.kv_cache_bytes.labels(self.name).set(self.kv.held_bytes)
        self.metrics.kv_cache_shared_tokens.labels(self.name).set(self.kv.shared_tokens)

    def _update_gauges(self) -> None:
        self.metrics.prefix_cache_bytes.labels(self.name).set(self.prefix_store.bytes)
        self.metrics.requests_waiting.labels(self.name).set(len(self.waiting))
        self.metrics.requests_running.labels(self.name).set(
            len(self.batch) + (len(self.prefill.seqs) if self.prefill else 0))

    def _drop_cancelled(self, ids: set[str]) -> None:
        """Requests whose client went away leave now, counted as ``abort`` like vLLM."""
        aborted = [s for s in self.waiting if s.request.request_id in ids]
        for seq in aborted:
            self.prefixes.release(seq)  # a disk read it waited for
        self.waiting = deque(s for s in self.waiting if s.request.request_id not in ids)
        if self.prefill is not None:
            for s in self.prefill.seqs:
                if s.request.request_id in ids and not s.cancelled:
                    s.cancelled = True
                    aborted.append(s)
        left = self._keep(lambda s: s.request.request_id not in ids)
        self._leave(left)
        for seq in aborted + left:
            seq.cancelled = True
            self.metrics.request_success.labels(self.name, "abort").inc()

    def _admit(self) -> None:
        """Start prefilling as many waiting requests as the batch and the KV
        budget have room for, in order, each from the longest prefix the cache
        holds of its context. A request that would make the others give up
        their cached prefixes, or would compute the same uncached prefix as
        one of them, waits for the next group."""
        room = self.config.max_batch_size - len(self.batch)
        if self.prefill_rows_alone:
            room = min(room, 1)
        if self.prefill is not None or room <= 0 or not self.waiting:
            return
        holds = self._own_tokens()
        running = bool(holds)  # rows that will give memory back as they finish
        starting = 0  # the KV bytes of the rows starting in this group
        seqs, contexts, limits, matches, later = [], [], [], [], deque()
        while self.waiting and len(seqs) < room:
            seq = self.waiting.popleft()
            context = seq.prefill_keys  # the prefix cache's view (an image's tokens keyed by its pixels)
            limit = self.speculator.prefix_limit(seq)
            match = self.prefixes.match(context, limit)
            if self.disk is not None:
                if self.disk.waits(seq, context, limit, match):
                    later.append(seq)  # its prefix is being read from disk; others go on
                    continue
                match = self.prefixes.match(context, limit)
            own = len(context) - self.prefixes.shared(context, match)
            if (holds or seqs) and not self.kv.fits(holds + [own]):
                self.waiting.appendleft(seq)  # the KV budget is full: in order, nobody passes it
                break
            need = starting + self.kv.row_bytes(own)
            if self.memory is not None and not self.memory.room(need, None if running else self.prefix_store):
                if running or seqs:
                    self.waiting.appendleft(seq)  # MLX's memory is short: in order, until rows finish
                    break
                self.prefixes.release(seq)  # nothing runs to give memory back: refused (HTTP 503)
                self.metrics.request_failure.labels(self.name, OUT_OF_MEMORY).inc()
                seq.emit(self.memory.refused(seq, need))
                continue
            if self.prefixes.admissible(contexts + [context], matches + [match], limits + [limit],
                                        self.chunks.tokens(bool(self.batch))):
                starting = need
                seqs.append(seq)
                contexts.append(context)
                limits.append(limit)
                matches.append(match)
                holds.append(own)
            else:
                later.append(seq)
        self.waiting = later + self.waiting
        if not seqs:
            return
        now = time.monotonic()
        for s in seqs:
            if not s.tokens:
                self.metrics.queue_time.labels(self.name).observe(now - s.arrival)
        run, cached = self.prefixes.plan(contexts, limits)
        width = max(len(c) for c in contexts)
        starts = self.prefixes.start(list(zip(seqs, contexts, cached)))
        for seq, n in zip(seqs, cached):
            seq.restored_tokens = n
            if not seq.tokens:
                seq.cached_tokens = n
        self.prefix_store.record(sum(map(len, contexts)), sum(cached))
        self.metrics.prefix_cache_queries.labels(self.name).inc(sum(map(len, contexts)))
        self.metrics.prefix_cache_hits.labels(self.name).inc(sum(cached))
        tokens = mx.array([[0] * (width - len(c)) + s.prefill_tokens for s, c in zip(seqs, contexts)])
        cache = make_row_cache(self.model, [max(0, run - len(c)) for c in contexts], starts, self.kv_quantization)
        own = [len(c) - cache.shared_tokens(b) for b, c in enumerate(contexts)]
        chunk = self.chunks.columns(len(seqs), bool(self.batch))  # a row prefilled in one chunk grows once anyway
        cache.reserve([n + ROUND_GROWTH if n > chunk else 0 for n in own])
        vision = self.runner.vision
        if vision is not None and vision.mrope is not None:  # text after a Qwen-VL prompt's images sits further on
            cache.shift([0 if s.request.images is None else s.request.images.rope_delta for s in seqs])
        self.prefill = PrefillGroup(seqs, contexts, tokens, cache, start=width - run, done=width - run)

    def _join(self, group: PrefillGroup) -> None:
        """After a group's last chunk its rows join the running batch, each row's next input its
        context's last token: this step's decode forward samples the rows' first tokens, with
        the batch's (no prefill computes logits)."""
        self.prefill = None
        fresh = [s for s in group.seqs if not s.tokens]
        self.metrics.prompt_tokens.labels(self.name).inc(sum(len(s.prompt) for s in fresh))
        self.metrics.prompt_images.labels(self.name).inc(sum(len(s.request.images.digests) for s in fresh
                                                             if s.request.images is not None))
        keep = [i for i, s in enumerate(group.seqs) if not s.cancelled]
        self._leave([s for i, s in enumerate(group.seqs) if i not in keep])
        if not keep:
            return
        if len(keep) < len(group.seqs):
            group.cache.select(keep)
        seqs = [group.seqs[i] for i in keep]
        self.batch.extend(seqs, group.cache, [s.next_input for s in seqs])

    def _record_prefill(self, group: PrefillGroup, end: int) -> None:
        """Record what each row's context has run so far (a later request can
        start from it while this group is still prefilling)."""
        for b, (seq, context) in enumerate(zip(group.seqs, group.contexts)):
            held = end - (group.width - len(context))
            if held > 0:
                self.prefixes.record(seq, context, held, group.cache, b, prompt=len(seq.prompt))


class RequestRejected(ValueError):
    """The request can never be served as asked; ``field`` names what is wrong."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_request(request: GenerationRequest, model: str, drafter: Method | None, max_context: int,
                  vocab: int, context_reason: str = "") -> None:
    """Raise RequestRejected if the request can never be served as asked
    (``context_reason``: why the context is shorter than the model's window)."""
    for token, _ in request.params.logit_bias:
        if not 0 <= token < vocab:
            raise RequestRejected(f"logit_bias names token {token}; this model's vocabulary is [0, {vocab})",
                                  "logit_bias")
    spec = request.speculation
    if spec is not None and spec.method in DRAFTERS and drafter != spec.method:
        what = DRAFTERS[spec.method]
        raise RequestRejected(f"model {model!r} has no {what}; declare a DraftPairing "
                              f"with method: {spec.method}, or ask for ngram", "speculation.method")
    if not request.prompt_tokens:
        raise RequestRejected("prompt is empty", "prompt")
    outside = next((t for t in (min(request.prompt_tokens), max(request.prompt_tokens)) if not 0 <= t < vocab), None)
    if outside is not None:  # an id past the embedding's rows would read outside it
        raise RequestRejected(f"prompt has token id {outside}; this model's vocabulary is [0, {vocab})", "prompt")
    if len(request.prompt_tokens) >= max_context:
        raise RequestRejected(
            f"prompt has {len(request.prompt_tokens)} tokens; this model's context "
            f"window is {max_context} tokens{context_reason}", "prompt")


DECODE_AHEAD_ENV = "SPECD_DECODE_AHEAD"  # "1" or "0": the daemon's engines run ahead, or not, on any device


def decodes_ahead_by_default() -> bool:
    """Whether plain steps start the next before reading their tokens (``runner.py``), unless the
    environment says (``SPECD_DECODE_AHEAD``): everywhere. On a GPU the kernels run while the CPU
    builds the next graph; MLX's CPU backend runs the device's work on a thread of its own, and
    there too the daemon served more tokens/s running ahead than stepping whole
    (``ops/bench/results/serve_vs_mlx_lm.json``, ``decode_ahead``)."""
    return os.environ.get(DECODE_AHEAD_ENV, "1") != "0"


def warm_up(model: nn.Module, quantization: KVQuantization | None = None) -> bool:
    """One token through a batched cache, at load: a model whose caches
    cannot batch (or be quantized as asked), or whose forward fails on this
    machine, fails to load with the reason instead of failing its first
    request. Returns whether its rows must be prefilled one at a time
    (``padding_leaks``)."""
    mx.eval(make_row_cache(model, [0], quantization=quantization).forward(model, mx.array([[0]])))
    return padding_leaks(model)
