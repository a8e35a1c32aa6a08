"""What is actually running: one entry per Model, with its engine and what it was built from.

The reconciler changes entries; the HTTP layer only reads them (``engine``,
``not_ready``).  Swapping an entry's engine is one assignment, so a request
either gets the old engine or the new one, never neither.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum

import structlog
from mlx.utils import tree_flatten

from ..api.manifest import DraftPairingSpec, ModelSpec, SpecPolicySpec, TopologySpec
from ..engine.engine import Engine, EngineConfig
from ..engine.loader import load_model
from ..metrics import Metrics
from ..spec.config import NO_SPECULATION, SpeculationConfig
from ..spec.eagle.checkpoint import load_head

log = structlog.get_logger(__name__)


class Phase(str, Enum):
    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    FAILED = "Failed"


@dataclass(frozen=True)
class Pairing:
    """A DraftPairing as applied to a model (name and generation identify it)."""

    name: str
    generation: int
    spec: DraftPairingSpec

    def speculation(self) -> SpeculationConfig:
        s = self.spec
        return SpeculationConfig(s.method, s.num_speculative_tokens, s.ngram_min, s.ngram_max,
                                 s.tree_top_k, s.tree_tokens)


@dataclass(frozen=True)
class Policy:
    name: str
    generation: int
    spec: SpecPolicySpec


@dataclass
class ServedModel:
    name: str
    generation: int  # the Model generation of ``spec``
    spec: ModelSpec
    phase: Phase = Phase.PENDING
    reason: str = ""
    engine: Engine | None = None
    load_seconds: float | None = None
    weight_bytes: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    pairing: Pairing | None = None  # applied to the engine
    pairing_error: str = ""
    policy: Policy | None = None  # applied to the engine
    task: asyncio.Task | None = None  # a load (or reload) in flight
    loading_generation: int | None = None
    # tensor parallelism: what the group was started on (topology name and
    # generation, pairing), its restarts, and when the next restart is due
    placement: tuple | None = None
    restarts: int = 0
    last_failure: str = ""
    retry_at: float | None = None


class ModelNotFound(KeyError):
    pass


class ModelNotReady(Exception):
    pass


def load_draft(pairing: Pairing | None, target, tokenizer):
    """The drafter a pairing needs: its draft model or EAGLE head (None for
    n-gram), checked against the target."""
    if pairing is None or pairing.spec.method == "ngram":
        return None
    if pairing.spec.method == "eagle":
        return load_head(pairing.spec.source, target)
    draft, draft_tokenizer = load_model(pairing.spec.source)
    check_draft_pair(target, tokenizer, draft, draft_tokenizer, pairing.name)
    return draft


@dataclass
class Built:
    engine: Engine
    weight_bytes: int
    pairing_error: str = ""  # the pairing could not be attached; the model serves without it


def build_engine(name: str, spec: ModelSpec, metrics: Metrics, pairing: Pairing | None) -> Built:
    """Load weights (and the pairing's draft) and build an engine ready to start.

    A draft that fails to load or does not match fails the pairing, not the model.
    """
    model, tokenizer = load_model(spec.source)
    config = EngineConfig(max_batch_size=spec.max_batch_size, max_waiting=spec.max_waiting,
                          prefill_step_tokens=spec.prefill_step_tokens, max_context=spec.max_context)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    try:
        draft = load_draft(pairing, model, tokenizer)
    except Exception as exc:
        engine = Engine(name, model, tokenizer, config, metrics)
        return Built(engine, weights, f"{type(exc).__name__}: {exc}")
    speculation = pairing.speculation() if pairing is not None else NO_SPECULATION
    return Built(Engine(name, model, tokenizer, config, metrics, speculation, draft), weights)


async def build_group(name: str, spec: ModelSpec, topology: TopologySpec, pairing: Pairing | None) -> Built:
    """Start a tensor-parallel group for the model; the pairing's draft is replicated on every rank."""
    from ..dist.group import start_group

    if pairing is not None and pairing.spec.method == "eagle":
        client = await start_group(name, spec, topology, NO_SPECULATION, None)
        return Built(client, client.weight_bytes, "EAGLE heads are not supported under tensor parallelism yet")
    speculation = pairing.speculation() if pairing is not None else NO_SPECULATION
    draft_source = pairing.spec.source if pairing is not None and pairing.spec.method == "draft" else None
    client = await start_group(name, spec, topology, speculation, draft_source)
    return Built(client, client.weight_bytes)


class ModelRegistry:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}

    def engine(self, name: str) -> Engine:
        """The engine serving ``name``; raises ModelNotFound or ModelNotReady."""
        served = self.models.get(name)
        if served is None:
            raise ModelNotFound(name)
        if served.engine is None:
            detail = f": {served.reason}" if served.reason else ""
            raise ModelNotReady(f"model {name!r} is {served.phase.value}{detail}")
        return served.engine

    def groups(self) -> list:
        """The tensor-parallel groups serving (their engines run in rank processes)."""
        from ..dist.group import GroupClient

        return [m.engine for m in self.models.values() if isinstance(m.engine, GroupClient)]

    def not_ready(self) -> dict[str, str]:
        """Reasons, by model, why the daemon is not ready (empty when it is)."""
        return {n: (f"{m.phase.value}: {m.reason}" if m.reason else m.phase.value)
                for n, m in self.models.items() if m.engine is None}

    async def shutdown(self, grace: float) -> None:
        for served in self.models.values():
            if served.task is not None:
                served.task.cancel()
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
