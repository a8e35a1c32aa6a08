"""What a Model asks of its node's memory, computed before anything is loaded.

A Model's request is the sum of what it will hold at most: its weights (the
bytes the checkpoint's safetensors headers declare, quantized tensors as
stored), its KV budget (``kvCache.maxBytes``, else the default the engine
would choose, from the checkpoint's ``config.json``), its prefix cache budget,
its pairing's drafter (a draft model's or EAGLE head's weights), and what an
engine holds beyond those (``ENGINE_OVERHEAD``, measured by
``ops/bench/scale_from_zero.py``). ``resources.memory`` replaces the sum, and the
budgets it does not name fit within it.
The engine is then built with exactly these budgets, so what was requested
bounds what it holds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ..api.manifest import ModelSpec
from ..core.cache import side_token_bytes
from ..core.columns import KVQuantization
from ..core.loader import UNDECLARED_CONTEXT, declared_window, is_local_source, resolve_source, with_text_config
from .kv_manager import KVManager, default_max_bytes as default_kv_bytes
from ..core.download import DRAFTER_FILES, MODEL_FILES, DownloadProgress, download

# An engine's threads and MLX's working buffers for a step's activations, beyond its budgets: at
# most a long prompt's prefill, whose attention keeps a bounded number of blocks of scores in flight
# however long the context (``core.attention._in_blocks``;
# tests/engine/test_step_memory.py)
ENGINE_OVERHEAD = 256 << 20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class MemoryRequest:
    weights: int
    kv_cache: int
    prefix_cache: int
    drafter: int
    overhead: int
    override: int | None = None  # resources.memory

    @property
    def total(self) -> int:
        if self.override is not None:
            return self.override
        return self.weights + self.kv_cache + self.prefix_cache + self.drafter + self.overhead

    def as_dict(self) -> dict:
        return {"memory": self.total, "weights": self.weights, "kvCache": self.kv_cache,
                "prefixCache": self.prefix_cache, "drafter": self.drafter, "overhead": self.overhead,
                "override": self.override is not None}


def rank_request(request: MemoryRequest, ranks: int, held: int = 1) -> MemoryRequest:
    """What ``held`` of a group's ``ranks`` ranks ask of one node: each rank holds its slice of the
    weights, the KV and the prefix cache (a tensor-parallel shard of every layer, or a pipeline
    stage's layers; the embedding and head a pipeline keeps on each stage are not counted), and a
    drafter and an engine's overhead of its own."""
    def part(n: int) -> int:
        return -(-n // ranks) * held
    return MemoryRequest(part(request.weights), part(request.kv_cache), part(request.prefix_cache),
                         request.drafter * held, request.overhead * held,
                         None if request.override is None else part(request.override))


def checkpoint_dir(source: str, revision: str | None = None, local_only: bool = False,
                   progress: DownloadProgress | None = None, patterns: list[str] = MODEL_FILES) -> Path:
    """The checkpoint's local directory: a path as given, or the hub snapshot (downloaded,
    with ``progress``, unless ``local_only``); raises (a passing error) when a hub checkpoint
    is not here and cannot be fetched."""
    if is_local_source(source):
        return Path(resolve_source(source))
    if local_only:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, revision=revision, allow_patterns=patterns, local_files_only=True))
    return download(source, revision, progress, patterns)


def safetensors_bytes(directory: Path) -> int:
    """Bytes of every tensor the directory's safetensors files hold, read from their headers only."""
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    if not total:
        raise FileNotFoundError(f"{directory} holds no safetensors weights")
    return total


def read_config(directory: Path) -> dict:
    return with_text_config(json.loads((directory / "config.json").read_text()))


def kv_token_bytes(config: dict, quantization: KVQuantization | None) -> int:
    """Keys and values of one token in every layer, as a configuration declares its attention
    (an estimate: sliding windows and latent attention are counted as full layers)."""
    layers = config.get("num_hidden_layers") or config.get("num_layers") or config.get("n_layer") or 0
    heads = config.get("num_attention_heads") or config.get("n_head") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    itemsize = DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 2)
    return 2 * layers * side_token_bytes(kv_heads, head_dim, itemsize, quantization)


def memory_request(spec: ModelSpec, drafter_source: str | None, allocatable: int,
                   local_only: bool = False, progress: DownloadProgress | None = None) -> MemoryRequest:
    """What the Model asks of a node with ``allocatable`` bytes (default budgets are shares of it);
    hub checkpoints are downloaded first (``progress``) unless ``local_only``. A hub checkpoint
    not cached yet is first measured where it is (``remote_request``): one that could never fit
    this node is not downloaded at all."""
    if not local_only and not is_local_source(spec.source) and cached_checkpoint(spec.source, spec.revision) is None:
        try:
            remote = remote_request(spec, drafter_source, allocatable)
        except Exception:  # nothing to read there (offline, the hub down): the download says why
            remote = None
        if remote is not None and remote.total > allocatable:
            return remote
    directory = checkpoint_dir(spec.source, spec.revision, local_only, progress)
    drafter = 0
    if drafter_source:
        drafter = safetensors_bytes(checkpoint_dir(drafter_source, None, local_only, progress, DRAFTER_FILES))
    return _request(spec, safetensors_bytes(directory), drafter, read_config(directory), allocatable)


def remote_request(spec: ModelSpec, drafter_source: str | None, allocatable: int) -> MemoryRequest:
    """The request of a hub checkpoint read on the hub: its safetensors headers (HTTP range
    requests, as ``huggingface_hub.get_safetensors_metadata`` reads them) and ``config.json``.

    The headers are read first: that read fails at once where no hub answers, while the
    configuration's download retries for about 23 s first (``huggingface_hub``'s own backoff), and
    the Model's own backoff is what should say that the hub cannot be reached."""
    from huggingface_hub import hf_hub_download

    weights = hub_safetensors_bytes(spec.source, spec.revision)
    config = json.loads(Path(hf_hub_download(spec.source, "config.json", revision=spec.revision)).read_text())
    drafter = 0
    if drafter_source:
        drafter = (safetensors_bytes(Path(resolve_source(drafter_source))) if is_local_source(drafter_source)
                   else hub_safetensors_bytes(drafter_source, None))
    return _request(spec, weights, drafter, with_text_config(config), allocatable)


def hub_safetensors_bytes(source: str, revision: str | None) -> int:
    """``safetensors_bytes`` of a hub checkpoint, from the headers alone."""
    from huggingface_hub import get_safetensors_metadata

    metadata = get_safetensors_metadata(source, revision=revision)
    return sum(t.data_offsets[1] - t.data_offsets[0] for f in metadata.files_metadata.values()
               for t in f.tensors.values())


def cached_checkpoint(source: str, revision: str | None) -> Path | None:
    """The hub checkpoint's snapshot directory if the cache holds its configuration and weights."""
    from huggingface_hub import snapshot_download

    try:
        directory = Path(snapshot_download(source, revision=revision, allow_patterns=MODEL_FILES,
                                           local_files_only=True))
    except Exception:
        return None
    return directory if (directory / "config.json").exists() and any(directory.glob("*.safetensors")) else None


def _request(spec: ModelSpec, weights: int, drafter: int, config: dict, allocatable: int) -> MemoryRequest:
    if spec.task == "embed":
        return MemoryRequest(weights, 0, 0, 0, ENGINE_OVERHEAD, spec.memory)
    # what ``resources.memory`` leaves the budgets it does not name, so that the engine built with
    # them holds no more than the Model asked for: the KV budget first, the prefix cache the rest
    room = None if spec.memory is None else max(0, spec.memory - weights - drafter - ENGINE_OVERHEAD
                                                - (spec.kv_cache_max_bytes or 0) - (spec.prefix_cache_max_bytes or 0))
    kv = spec.kv_cache_max_bytes
    if kv is None:
        quantization = KVQuantization(spec.kv_cache_bits, spec.kv_cache_group_size) if spec.kv_cache_bits else None
        context = declared_window(config) or UNDECLARED_CONTEXT
        if spec.max_context:
            context = min(context, spec.max_context)
        rows = KVManager(0, (kv_token_bytes(config, quantization), 0))
        kv = default_kv_bytes(allocatable, weights + drafter, rows, spec.max_batch_size, context, room)
        room = None if room is None else max(0, room - kv)
    prefix = spec.prefix_cache_max_bytes
    if prefix is None:
        prefix = default_prefix_bytes(allocatable, kv)
        if room is not None:
            prefix = min(prefix, room)
    return MemoryRequest(weights, kv, prefix, drafter, ENGINE_OVERHEAD, spec.memory)


def default_prefix_bytes(allocatable: int, kv_cache: int) -> int:
    """The prefix cache of a Model that names no budget: as much as its running rows may
    hold (what a batch of finished conversations leaves behind), at most a tenth of the node."""
    return min(kv_cache, allocatable // 10)
