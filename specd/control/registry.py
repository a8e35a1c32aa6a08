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

from ..api.manifest import DraftPairingSpec, ModelSpec, Resource, resolve_source
from ..engine.engine import Engine, EngineConfig
from ..engine.loader import load_model
from ..metrics import Metrics
from ..spec.config import NO_SPECULATION, SpeculationConfig

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
        self.pairings: dict[str, Resource] = {}  # by target model name

    def declare(self, resource: Resource) -> None:
        if resource.kind == "DraftPairing":
            self.pair(resource)
        else:
            self.declare_model(resource)

    def pair(self, resource: Resource) -> None:
        target = resource.spec.target_ref
        other = self.pairings.get(target)
        if other is not None and other.name != resource.name:
            raise ValueError(f'Model "{target}" already has DraftPairing "{other.name}"; '
                             f'"{resource.name}" would be a second one')
        self.pairings[target] = resource

    def declare_model(self, resource: Resource) -> ServedModel:
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
            speculation, draft = await asyncio.to_thread(self._load_pairing, served.name, model, tokenizer)
            spec = served.spec
            config = EngineConfig(max_batch_size=spec.max_batch_size, max_waiting=spec.max_waiting,
                                  prefill_step_tokens=spec.prefill_step_tokens, max_context=spec.max_context)
            engine = Engine(served.name, model, tokenizer, config, self.metrics, speculation, draft)
        except Exception as exc:
            served.phase, served.reason = Phase.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("model failed to load", model=served.name, reason=served.reason)
            return
        engine.start()
        served.engine, served.phase = engine, Phase.READY
        served.load_seconds = time.monotonic() - started
        self.metrics.model_ready.labels(served.name).set(1)
        log.info("model ready", model=served.name, seconds=round(served.load_seconds, 2))

    def _load_pairing(self, name: str, model, tokenizer) -> tuple[SpeculationConfig, object]:
        """The model's speculation default and draft model, from its DraftPairing."""
        pairing = self.pairings.get(name)
        if pairing is None:
            return NO_SPECULATION, None
        spec: DraftPairingSpec = pairing.spec
        config = SpeculationConfig(spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
        if spec.method != "draft":
            return config, None
        draft, draft_tokenizer = load_model(resolve_source(spec.source, pairing.origin))
        check_draft_pair(model, tokenizer, draft, draft_tokenizer, pairing.name)
        return config, draft

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


def check_draft_pair(target, target_tokenizer, draft, draft_tokenizer, pairing: str) -> None:
    """Refuse a draft whose tokens do not mean the same as the target's."""
    tv, dv = target.args.vocab_size, draft.args.vocab_size
    if tv != dv:
        raise ValueError(f"DraftPairing {pairing}: draft vocabulary has {dv} tokens, the target's {tv}")
    if set(target_tokenizer.eos_token_ids) != set(draft_tokenizer.eos_token_ids):
        raise ValueError(f"DraftPairing {pairing}: draft EOS ids {sorted(draft_tokenizer.eos_token_ids)} "
                         f"differ from the target's {sorted(target_tokenizer.eos_token_ids)}")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"DraftPairing {pairing}: draft and target tokenizers differ")
