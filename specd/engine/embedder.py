"""What serves a Model whose ``spec.task`` is ``embed``: one thread that
batches the inputs of concurrent embedding requests into shared forwards.

It has the lifecycle, fault and load surface the control plane reads of a
``ServingEngine`` (start, shutdown, in-flight count, faults), not generation.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import structlog

from ..core.embedding import Pooling, embed_long, embed_rows
from ..core.loader import text_config, vocab_size
from ..metrics import Metrics
from . import threads
from .engine import EngineOverloaded, EngineUnavailable
from .interface import drain_within
from .scheduler import RequestRejected

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EmbedderConfig:
    max_batch_size: int = 16  # rows in one forward
    max_waiting: int = 64  # requests queued before new ones get a 429
    max_context: int = 2048  # tokens one input may hold
    chunk_tokens: int = 512  # a longer input runs alone, this many tokens a forward


@dataclass
class _Job:
    rows: list[list[int]]
    done: Callable[[np.ndarray | None, Exception | None], None]  # called once, from the embedder thread
    vectors: list[mx.array | None] = field(default_factory=list)
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.rows)


def check_rows(rows: list[list[int]], model: str, max_context: int, vocab: int) -> None:
    """Raise RequestRejected naming the first input that can never be embedded."""
    for i, row in enumerate(rows):
        if not row:
            raise RequestRejected(f"input[{i}] is empty", f"input[{i}]")
        if len(row) > max_context:
            raise RequestRejected(f"input[{i}] has {len(row)} tokens; model {model!r} embeds at most "
                                  f"{max_context}", f"input[{i}]")
        if min(row) < 0 or max(row) >= vocab:
            raise RequestRejected(f"input[{i}] holds a token id outside 0..{vocab - 1}", f"input[{i}]")


class EmbeddingFailed(Exception):
    """The batch that held the request failed (HTTP 500); the embedder serves on."""


class Embedder:
    """Serves one embedding model in this process."""

    failure: str | None = None  # a local embedder fails requests, not itself

    def __init__(self, name: str, model: nn.Module, tokenizer, pooling: Pooling,
                 config: EmbedderConfig = EmbedderConfig(), metrics: Metrics | None = None,
                 on_fault: Callable[[], None] | None = None):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.pooling, self.config = pooling, config
        self.vocab_size = vocab_size(model)
        self.dimensions = int(text_config(model)["hidden_size"])
        self.metrics = metrics or Metrics()
        self.fault: str | None = None  # the last batch's fault, until a later batch succeeds
        self.faults = 0
        self._on_fault = on_fault
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running = 0
        self._accepting, self._stopped = True, False
        self._stepped: threading.Event | None = None  # set once its loop has returned (``threads.run``)

    @property
    def max_context(self) -> int:
        return self.config.max_context

    @property
    def in_flight(self) -> int:
        with self._cv:
            return len(self._queue) + self._running

    def start(self) -> None:
        self._stepped = threads.run(self._run, f"embedder-{self.name}")

    def group_status(self) -> dict | None:
        return None

    def exported_metrics(self) -> str | None:
        return None

    def check_rows(self, rows: list[list[int]]) -> None:
        check_rows(rows, self.name, self.max_context, self.vocab_size)

    async def embed(self, rows: list[list[int]]) -> np.ndarray:
        """The embeddings of ``rows`` (token ids), ``[len(rows), dimensions]`` float32."""
        self.check_rows(rows)
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()

        def done(vectors: np.ndarray | None, error: Exception | None) -> None:
            loop.call_soon_threadsafe(_settle, result, vectors, error)

        job = _Job(rows, done)
        with self._cv:
            if not self._accepting:
                raise EngineUnavailable(f"model {self.name!r} is shutting down")
            if len(self._queue) >= self.config.max_waiting:
                self.metrics.request_failure.labels(self.name, "overloaded").inc()
                raise EngineOverloaded(f"model {self.name!r} has {self.config.max_waiting} requests waiting; "
                                       "retry later")
            self._queue.append(job)
            self._cv.notify()
        try:
            return await result
        finally:
            job.cancelled = not result.done()

    async def shutdown(self, grace: float = 30.0) -> None:
        """Stop accepting, let queued requests finish within ``grace`` (``drain_within``), then stop."""
        with self._cv:
            self._accepting = False
        await drain_within(lambda: self.in_flight > 0, grace)
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._stepped is not None:
            await asyncio.to_thread(self._stepped.wait, 10.0)

    # -- embedder thread ---------------------------------------------------

    def _take(self) -> list[_Job] | None:
        """Wait for work; take the jobs whose rows fill the next forward (None: stop)."""
        with self._cv:
            while not (self._queue or self._stopped):
                self._cv.wait()
            if self._stopped:
                return None
            jobs, rows = [], 0
            while self._queue and (not jobs or rows + len(self._queue[0].rows) <= self.config.max_batch_size):
                job = self._queue.popleft()
                if not job.cancelled:
                    jobs.append(job)
                    rows += len(job.rows)
            self._running = len(jobs)
            return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            try:
                vectors = self._embed(jobs)
            except Exception as exc:  # a fault fails the batch's requests, not the daemon
                log.exception("embedding batch failed", model=self.name)
                vectors = None
                self.fault, self.faults = f"{type(exc).__name__}: {exc}", self.faults + 1
                self.metrics.engine_faults.labels(self.name).inc()
            # the embedder's state is settled before the batch's requests hear of it
            recovered = vectors is not None and self.fault is not None
            if recovered:
                self.fault = None
            with self._cv:
                self._running = 0
            if vectors is None or recovered:
                self._notify()
            for i, job in enumerate(jobs):
                if vectors is None:
                    self.metrics.request_failure.labels(self.name, "engine_error").inc()
                    job.done(None, EmbeddingFailed(f"engine error: {self.fault}"))
                else:
                    self.metrics.prompt_tokens.labels(self.name).inc(sum(len(r) for r in job.rows))
                    self.metrics.request_success.labels(self.name, "embedded").inc()
                    job.done(vectors[i], None)
        with self._cv:
            left, self._queue = list(self._queue), deque()
        for job in left:
            job.done(None, EngineUnavailable(f"model {self.name!r} stopped"))

    def _notify(self) -> None:
        if self._on_fault is not None:
            self._on_fault()

    def _embed(self, jobs: list[_Job]) -> list[np.ndarray]:
        """Each job's vectors. Short rows share forwards of at most ``max_batch_size``
        rows; a row longer than ``chunk_tokens`` runs alone, in chunks."""
        pieces = [(job, i) for job in jobs for i in range(len(job.rows))]
        short = [p for p in pieces if len(p[0].rows[p[1]]) <= self.config.chunk_tokens]
        for job, i in pieces:
            if len(job.rows[i]) > self.config.chunk_tokens:
                job.vectors[i] = embed_long(self.model, job.rows[i], self.pooling, self.config.chunk_tokens)[0]
        short.sort(key=lambda p: len(p[0].rows[p[1]]))  # rows of like length pad little
        size = self.config.max_batch_size
        for start in range(0, len(short), size):
            group = short[start:start + size]
            vectors = embed_rows(self.model, [job.rows[i] for job, i in group], self.pooling)
            mx.eval(vectors)  # one forward's activations at a time
            for row, (job, i) in enumerate(group):
                job.vectors[i] = vectors[row]
        stacked = [mx.stack(job.vectors) for job in jobs]
        mx.eval(stacked)
        return [np.array(rows, dtype=np.float32) for rows in stacked]


def _settle(result: asyncio.Future, vectors: np.ndarray | None, error: Exception | None) -> None:
    if result.done():
        return
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(vectors)
