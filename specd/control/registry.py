"""The daemon's served models: declared, loading, ready or failed.

Each declared Model is loaded off the event loop; a model that fails to load
is marked Failed with its reason while the others keep serving.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import Enum

import structlog

from ..api.manifest import ModelSpec, Resource, resolve_source
from ..engine.engine import Engine, EngineConfig
from ..engine.loader import load_model
from ..metrics import Metrics

log = structlog.get_logger(__name__)


class Phase(str, Enum):
    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    FAILED = "Failed"


@dataclass
class ServedModel:
    name: str
    spec: ModelSpec
    source: str
    phase: Phase = Phase.PENDING
    reason: str = ""
    engine: Engine | None = None
    load_seconds: float | None = None
    created: int = 0


class ModelNotFound(KeyError):
    pass


class ModelNotReady(Exception):
    pass


class ModelRegistry:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}

    def declare(self, resource: Resource) -> ServedModel:
        spec: ModelSpec = resource.spec
        served = ServedModel(resource.name, spec, resolve_source(spec.source, resource.origin),
                             created=int(time.time()))
        self.models[resource.name] = served
        self.metrics.model_ready.labels(resource.name).set(0)
        return served

    async def load(self, served: ServedModel) -> None:
        """Load one model and start its engine; failures stay with that model."""
        served.phase = Phase.LOADING
        started = time.monotonic()
        log.info("model loading", model=served.name, source=served.source)
        try:
            model, tokenizer = await asyncio.to_thread(load_model, served.source)
            spec = served.spec
            config = EngineConfig(max_batch_size=spec.max_batch_size, max_waiting=spec.max_waiting,
                                  prefill_step_tokens=spec.prefill_step_tokens, max_context=spec.max_context)
            engine = Engine(served.name, model, tokenizer, config, self.metrics)
        except Exception as exc:
            served.phase, served.reason = Phase.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("model failed to load", model=served.name, reason=served.reason)
            return
        engine.start()
        served.engine, served.phase = engine, Phase.READY
        served.load_seconds = time.monotonic() - started
        self.metrics.model_ready.labels(served.name).set(1)
        log.info("model ready", model=served.name, seconds=round(served.load_seconds, 2))

    async def load_all(self) -> None:
        for served in list(self.models.values()):
            if served.phase is Phase.PENDING:
                await self.load(served)

    def engine(self, name: str) -> Engine:
        """The engine serving ``name``; raises ModelNotFound or ModelNotReady."""
        served = self.models.get(name)
        if served is None:
            raise ModelNotFound(name)
        if served.phase is not Phase.READY:
            detail = f": {served.reason}" if served.reason else ""
            raise ModelNotReady(f"model {name!r} is {served.phase.value}{detail}")
        return served.engine

    def not_ready(self) -> dict[str, str]:
        """Reasons, by model, why the daemon is not ready (empty when it is)."""
        return {n: (f"{m.phase.value}: {m.reason}" if m.reason else m.phase.value)
                for n, m in self.models.items() if m.phase is not Phase.READY}

    async def shutdown(self, grace: float) -> None:
        engines = [m.engine for m in self.models.values() if m.engine is not None]
        await asyncio.gather(*(e.shutdown(grace) for e in engines))
