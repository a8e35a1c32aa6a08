"""Starting what placement decided runs on this daemon: a local engine (or embedder) within the
memory its request counted, or a tensor- or pipeline-parallel group on the hosts chosen for its
ranks. The Model reconciler decides where (``placement.py``) and when; this is the one step that
turns a ``Placement`` into a ``ServingEngine``. Replicas on other Nodes are started by their own
daemons, applied there by the head (``replicas.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..api.manifest import ModelSpec
from ..core.loader import checkpoint_directory, context_window, load_embedding_model, load_model, weight_bytes
from ..core.prefix_disk import DiskConfig, checkpoint_identity, default_max_bytes
from ..core.request import DRAFTERS, Method, NO_SPECULATION
from ..core.vision import VisionTower, VisionUnavailable, takes_images
from ..engine.embedder import Embedder, EmbedderConfig
from ..engine.engine import Engine, load_drafter
from ..engine.interface import ServingEngine
from ..engine.scheduler import EngineConfig
from ..metrics import Metrics
from ..parallel.group import start_group
from .placement import Placement
from .state import Pairing


@dataclass
class Started:
    engine: ServingEngine | Embedder
    weight_bytes: int
    pairing_error: str = ""  # the pairing could not be attached; the model serves without it


async def launch(name: str, spec: ModelSpec, pairing: Pairing | None, placed: Placement, metrics: Metrics,
                 on_fault: Callable[[], None], prefix_disk_root: Path) -> Started:
    """Start the Model's engine as ``placed`` says, not yet serving (``engine.start()`` does).

    A local engine loads its weights (and the pairing's drafter) off the event loop, with the KV
    and prefix budgets its memory request counted. A group's ranks load their own shards; the
    pairing's draft model is replicated on every rank. An embedding model takes no pairing.
    ``prefix_disk_root``: where a Model's disk tier goes unless its spec names a path."""
    if placed.topology is not None:
        return await _group(name, spec, placed, pairing, on_fault)
    if spec.task == "embed":
        return await asyncio.to_thread(_embedder, name, spec, metrics, on_fault)
    return await asyncio.to_thread(_engine, name, spec, metrics, pairing, placed, on_fault, prefix_disk_root)


def _engine(name: str, spec: ModelSpec, metrics: Metrics, pairing: Pairing | None, placed: Placement,
            on_fault: Callable[[], None], prefix_disk_root: Path) -> Started:
    """A drafter that fails to load or does not match fails the pairing, not the model."""
    model, tokenizer = load_model(spec.source, spec.revision)
    config = EngineConfig(max_batch_size=spec.max_batch_size, max_waiting=spec.max_waiting,
                          prefill_step_tokens=spec.prefill_step_tokens, max_context=spec.max_context,
                          prefix_cache_bytes=placed.request.prefix_cache, kv_cache_bytes=placed.request.kv_cache,
                          kv_bits=spec.kv_cache_bits, kv_group_size=spec.kv_cache_group_size,
                          prefix_disk=_prefix_disk(name, spec, prefix_disk_root))
    speculation, drafter, pairing_error = NO_SPECULATION, None, ""
    if pairing is not None:
        try:
            # an MTP head is read from the files the target was loaded from, at its revision
            source = (str(checkpoint_directory(spec.source, spec.revision)) if pairing.method == Method.MTP
                      else pairing.spec.source)
            drafter = None if pairing.method == Method.NGRAM else load_drafter(
                pairing.method, source, pairing.name, model, tokenizer)
            speculation = pairing.speculation()
        except Exception as exc:
            pairing_error = f"{type(exc).__name__}: {exc}"
    vision, refusal = _vision(spec, model)
    engine = Engine(name, model, tokenizer, config, metrics, speculation, drafter, on_fault, vision, refusal)
    return Started(engine, weight_bytes(model) + (vision.weight_bytes if vision else 0), pairing_error)


def _vision(spec: ModelSpec, model) -> tuple[VisionTower | None, str]:
    """The Model's vision tower, where its checkpoint has one (or its ``modalities`` name image),
    else why it takes no images. Asked for by name, a tower that cannot load fails the Model; found
    in the checkpoint, it leaves the Model serving text, saying why."""
    if spec.modalities is not None and "image" not in spec.modalities:
        return None, "its modalities name only text"
    directory = checkpoint_directory(spec.source, spec.revision)
    if not takes_images(directory):
        if spec.modalities is not None:
            raise ValueError(f"modalities names image, but {spec.source} has no vision tower "
                             "(its config.json has no vision_config)")
        return None, "its checkpoint has no vision tower"
    try:
        return VisionTower(directory, model), ""
    except VisionUnavailable as exc:
        if spec.modalities is not None:
            raise ValueError(f"modalities names image, but {exc}") from None
        return None, str(exc)


def _prefix_disk(name: str, spec: ModelSpec, root: Path) -> DiskConfig | None:
    """The Model's disk tier: its own directory (its blocks never evict another Model's), its
    checkpoint's identity (read from the files it loaded, at its revision)."""
    disk = spec.prefix_cache_disk
    if disk is None:
        return None
    directory = (Path(disk.path).expanduser() if disk.path else root) / name
    identity = checkpoint_identity(checkpoint_directory(spec.source, spec.revision))
    return DiskConfig(directory, disk.max_bytes or default_max_bytes(directory), identity)


def _embedder(name: str, spec: ModelSpec, metrics: Metrics, on_fault: Callable[[], None]) -> Started:
    model, tokenizer, pooling = load_embedding_model(spec.source, spec.revision)
    window = context_window(model, tokenizer)
    config = EmbedderConfig(max_batch_size=spec.max_batch_size, max_waiting=spec.max_waiting,
                            max_context=min(spec.max_context or window, window),
                            chunk_tokens=spec.prefill_step_tokens)
    return Started(Embedder(name, model, tokenizer, pooling, config, metrics, on_fault), weight_bytes(model))


async def _group(name: str, spec: ModelSpec, placed: Placement, pairing: Pairing | None,
                 on_failure: Callable[[], None]) -> Started:
    speculation, draft_source, pairing_error = NO_SPECULATION, None, ""
    if pairing is not None and pairing.method in (Method.EAGLE, Method.MTP, Method.DFLASH):
        pairing_error = (f"{DRAFTERS[pairing.method]}s read the target's hidden states, which are not gathered "
                         "under tensor or pipeline parallelism yet")
    elif pairing is not None:
        speculation = pairing.speculation()
        draft_source = pairing.spec.source if pairing.method == Method.DRAFT else None
    client = await start_group(name, spec, placed.topology, on_failure, speculation, draft_source)
    return Started(client, client.weight_bytes, pairing_error)
