"""Manifest types (``apiVersion: specd.dev/v1alpha1``) and their validation.

A manifest is checked whole before anything is acted on: every problem is
reported with the file, the field path (``spec.source``) and the reason, in
the style of Kubernetes admission errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from .paths import API_VERSION
from .text import LONE_SURROGATE, lone_surrogate_path, shown

NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label, matched whole
MAX_ALIASES = 64  # YAML aliases one manifest may use: enough for shared blocks, never a "billion laughs"
MAX_EXPANDED_NODES = 100_000  # nodes one document may stand for, aliases expanded (a real one has hundreds)
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
PARALLELISM = ("tensor", "pipeline", "auto")  # how a Topology's ranks split a Model (auto: the faster, timed)
TASKS = ("generate", "embed")  # what a Model serves: completions (chat, Messages, Responses) | /v1/embeddings


class ManifestError(ValueError):
    """A manifest that cannot be admitted, with where and why."""

    def __init__(self, reason: str, path: str = "", file: str | None = None):
        self.reason, self.path, self.file = reason, path, file
        where = ":".join(p for p in (file, path) if p)
        super().__init__(f"{where}: {reason}" if where else reason)


@dataclass(frozen=True)
class PrefixDisk:
    """``prefixCache.disk``: the prefix cache's disk tier (``core/prefix_disk.py``)."""

    path: str | None = None  # None: the daemon's state directory's prefix-cache/
    max_bytes: int | None = None  # None: a quarter of the free space there


@dataclass(frozen=True)
class ModelSpec:
    """What a served model should be: where its weights are and its limits."""

    source: str
    revision: str | None = None
    topology_ref: str | None = None
    max_batch_size: int = 32  # as many rows as mlx_lm.server decodes together by default
    max_waiting: int = 64
    max_context: int | None = None
    prefill_step_tokens: int = 512
    prefix_cache_max_bytes: int | None = None  # None: a tenth of the host's memory; 0: off
    prefix_cache_disk: PrefixDisk | None = None  # the disk tier under it, or none
    kv_cache_max_bytes: int | None = None  # None: engine.kv_manager.default_max_bytes
    kv_cache_bits: int | None = None  # keys and values stored quantized (4 or 8 bits), or in the model's dtype
    kv_cache_group_size: int = 64
    task: str = "generate"  # one of TASKS: what the Model serves
    modalities: tuple[str, ...] | None = None  # what its prompts may hold (MODALITIES); None: what the checkpoint takes
    memory: int | None = None  # resources.memory: what the Model requests of the node (None: computed)
    min_replicas: int = 1  # scaling.minReplicas: 0 loads on demand and unloads when idle
    idle_seconds: float = 900.0  # scaling.idleSeconds: unused this long, a Model at minReplicas 0 unloads
    priority: str = "normal"  # scaling.priority: one of PRIORITIES; the lowest is evicted first
    replicas: int = 1  # on a cluster head: copies (groups, with topologyRef) on as many Nodes, routed between

    @property
    def priority_value(self) -> int:
        return PRIORITIES[self.priority]


# what a prompt may hold besides text
MODALITIES = ("text", "image")

# priority classes, as Kubernetes' PriorityClass names a value: an idle Model of a lower class makes room first
PRIORITIES = {"low": -100, "normal": 0, "high": 100}


@dataclass(frozen=True)
class Resource:
    api_version: str
    kind: str
    name: str
    spec: Any  # the parsed spec dataclass
    raw_spec: dict = field(default_factory=dict)  # the spec as written (what the store keeps)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    origin: str | None = None  # the file it came from, for messages and relative paths
    resource_version: str | None = None  # the version the client read, for optimistic concurrency

    def store_item(self, **annotations: str) -> dict:
        """The resource as the store applies it (``annotations`` added to its own)."""
        return {"kind": self.kind, "name": self.name, "labels": self.labels,
                "annotations": {**self.annotations, **annotations}, "spec": self.raw_spec,
                "resourceVersion": self.resource_version}


def _check_type(value: Any, kind: type | tuple, path: str) -> Any:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ManifestError(f"expected {_type_name(kind)}, got boolean", path)
    if not isinstance(value, kind):
        raise ManifestError(f"expected {_type_name(kind)}, got {type(value).__name__}", path)
    return value


def _type_name(kind: type | tuple) -> str:
    names = {str: "string", int: "integer", float: "number", dict: "object", list: "array", bool: "boolean"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _fields(obj: Any, path: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
    _check_type(obj, dict, path)
    for key in obj:
        if key not in allowed:
            named = key if isinstance(key, str) and len(key) <= 80 else shown(key)
            raise ManifestError(f"unknown field {shown(key)}", f"{path}.{named}" if path else named)
    for key in sorted(required - obj.keys()):
        raise ManifestError("required field is missing", f"{path}.{key}" if path else key)
    return obj


def _positive_int(obj: dict, key: str, path: str, default: int | None) -> int | None:
    if key not in obj:
        return default
    value = _check_type(obj[key], int, f"{path}.{key}")
    if value < 1:
        raise ManifestError(f"must be at least 1, got {shown(value)}", f"{path}.{key}")
    return value


def _optional_str(obj: dict, key: str, path: str) -> str | None:
    if key not in obj:
        return None
    value = _check_type(obj[key], str, f"{path}.{key}")
    if not value.strip():
        raise ManifestError("must not be empty", f"{path}.{key}")
    return value


def _parse_model_spec(spec: Any, path: str = "spec") -> ModelSpec:
    keys = {"source", "revision", "topologyRef", "maxBatchSize", "maxWaiting", "maxContext",
            "prefillStepTokens", "prefixCache", "kvCache", "task", "modalities", "resources", "scaling", "replicas"}
    _fields(spec, path, keys, {"source"})
    task = spec.get("task", "generate")
    if not isinstance(task, str) or task not in TASKS:
        raise ManifestError(f"must be one of {', '.join(TASKS)}, got {shown(task)}", f"{path}.task")
    if task == "embed" and "topologyRef" in spec:
        raise ManifestError("an embedding model runs on one host: it takes no topologyRef", f"{path}.topologyRef")
    prefix_cache = _fields(spec.get("prefixCache", {}), f"{path}.prefixCache", {"maxBytes", "disk"})
    prefix_disk = _prefix_disk(prefix_cache, spec, f"{path}.prefixCache")
    kv_cache = _fields(spec.get("kvCache", {}), f"{path}.kvCache", {"maxBytes", "bits", "groupSize"})
    kv_bits = _choice(kv_cache, "bits", f"{path}.kvCache", KV_BITS, None)
    kv_group_size = _choice(kv_cache, "groupSize", f"{path}.kvCache", KV_GROUP_SIZES, 64)
    if task == "embed" and "kvCache" in spec:
        raise ManifestError("an embedding model keeps no KV cache between requests", f"{path}.kvCache")
    if _byte_size(kv_cache, "maxBytes", f"{path}.kvCache") == 0:
        raise ManifestError("must be positive: a Model needs KV memory for at least one row",
                            f"{path}.kvCache.maxBytes")
    modalities = _modalities(spec, task, path)
    resources = _fields(spec.get("resources", {}), f"{path}.resources", {"memory"})
    memory = _byte_size(resources, "memory", f"{path}.resources")
    if memory == 0:
        raise ManifestError("must be positive: a Model's weights take memory", f"{path}.resources.memory")
    scaling = _fields(spec.get("scaling", {}), f"{path}.scaling", {"minReplicas", "idleSeconds", "priority"})
    min_replicas = _choice(scaling, "minReplicas", f"{path}.scaling", (0, 1), 1)
    idle_seconds = _number(scaling, "idleSeconds", f"{path}.scaling", 1.0, 365 * 86400.0, ModelSpec.idle_seconds)
    priority = scaling.get("priority", "normal")
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise ManifestError(f"unknown priority class {shown(priority)} (known: {', '.join(PRIORITIES)})",
                            f"{path}.scaling.priority")
    replicas = _positive_int(spec, "replicas", path, 1)
    if "topologyRef" in spec and min_replicas == 0:
        raise ManifestError("a tensor-parallel group stays loaded: minReplicas 0 is for Models on this node",
                            f"{path}.scaling.minReplicas")
    source = _optional_str(spec, "source", path)
    defaults = ModelSpec(source=source)
    return ModelSpec(
        source=source,
        revision=_optional_str(spec, "revision", path),
        topology_ref=_optional_str(spec, "topologyRef", path),
        max_batch_size=_positive_int(spec, "maxBatchSize", path, defaults.max_batch_size),
        max_waiting=_positive_int(spec, "maxWaiting", path, defaults.max_waiting),
        max_context=_positive_int(spec, "maxContext", path, None),
        prefill_step_tokens=_positive_int(spec, "prefillStepTokens", path, defaults.prefill_step_tokens),
        prefix_cache_max_bytes=_byte_size(prefix_cache, "maxBytes", f"{path}.prefixCache"),
        prefix_cache_disk=prefix_disk,
        kv_cache_max_bytes=_byte_size(kv_cache, "maxBytes", f"{path}.kvCache"),
        kv_cache_bits=kv_bits,
        kv_cache_group_size=kv_group_size,
        task=task,
        modalities=modalities,
        memory=memory,
        min_replicas=min_replicas,
        idle_seconds=idle_seconds,
        priority=priority,
        replicas=replicas,
    )


def _modalities(spec: dict, task: str, path: str) -> tuple[str, ...] | None:
    """``modalities``: text, and image where the checkpoint has a vision tower (mlx-vlm reads it)."""
    if "modalities" not in spec:
        return None
    value = spec["modalities"]
    if not isinstance(value, list) or not value:
        raise ManifestError(f"must be a non-empty list of {', '.join(MODALITIES)}", f"{path}.modalities")
    for i, item in enumerate(value):
        if item not in MODALITIES:
            raise ManifestError(f"must be one of {', '.join(MODALITIES)}, got {shown(item)}", f"{path}.modalities[{i}]")
    if "text" not in value:
        raise ManifestError("every Model takes text", f"{path}.modalities")
    if len(set(value)) != len(value):
        raise ManifestError("names a modality twice", f"{path}.modalities")
    if "image" in value and (task == "embed" or "topologyRef" in spec):
        where = "an embedding model" if task == "embed" else "a tensor- or pipeline-parallel group"
        raise ManifestError(f"{where} takes no images yet", f"{path}.modalities")
    return tuple(value)


def _prefix_disk(prefix_cache: dict, spec: dict, path: str) -> PrefixDisk | None:
    """``prefixCache.disk``: what the RAM tree records, kept on disk for one engine on this host."""
    if "disk" not in prefix_cache:
        return None
    disk = _fields(prefix_cache["disk"] if prefix_cache["disk"] is not None else {}, f"{path}.disk",
                   {"path", "maxBytes"})
    if _byte_size(prefix_cache, "maxBytes", path) == 0:
        raise ManifestError("the disk tier keeps what the RAM prefix cache records: maxBytes 0 turns that off",
                            f"{path}.disk")
    if spec.get("task") == "embed":
        raise ManifestError("an embedding model keeps no prefix cache", f"{path}.disk")
    if "topologyRef" in spec:
        raise ManifestError("a tensor- or pipeline-parallel group keeps its prefix cache in RAM only", f"{path}.disk")
    directory = _optional_str(disk, "path", f"{path}.disk")
    if directory is not None and not directory.startswith(("/", "~")):
        raise ManifestError(f"must be an absolute path, got {shown(directory)}", f"{path}.disk.path")
    max_bytes = _byte_size(disk, "maxBytes", f"{path}.disk")
    if max_bytes == 0:
        raise ManifestError("must be positive (leave out disk for no disk tier)", f"{path}.disk.maxBytes")
    return PrefixDisk(directory, max_bytes)


BYTE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
              "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
BYTE_SIZE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?$")


KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


def _choice(obj: dict, key: str, path: str, allowed: tuple[int, ...], default: int | None) -> int | None:
    """An integer that must be one of ``allowed``."""
    if key not in obj:
        return default
    value = obj[key]
    if isinstance(value, bool) or value not in allowed:
        raise ManifestError(f"must be one of {', '.join(map(str, allowed))}, got {shown(value)}", f"{path}.{key}")
    return value


def _byte_size(obj: dict, key: str, path: str) -> int | None:
    """A size in bytes: an integer, or a Kubernetes quantity such as "8Gi" or "500M"."""
    if key not in obj:
        return None
    value = obj[key]
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ManifestError(f"must not be negative, got {shown(value)}", f"{path}.{key}")
        return value
    _check_type(value, str, f"{path}.{key}")
    try:
        return byte_size(value)
    except ValueError as err:
        raise ManifestError(str(err), f"{path}.{key}") from None


def byte_size(text: str) -> int:
    """Bytes from a Kubernetes quantity such as "8Gi" or "500M" (or a plain integer)."""
    found = BYTE_SIZE_RE.match(text.strip())
    if found is None:
        raise ValueError(f'expected a byte size such as 8Gi or 500M, got {shown(text)}')
    return int(float(found.group(1)) * BYTE_UNITS[found.group(2) or ""])


@dataclass(frozen=True)
class DraftPairingSpec:
    """How a Model speculates: n-gram lookup, a draft model, an EAGLE head, the target's MTP head or a
    DFlash drafter, and how far."""

    target_ref: str
    method: str
    source: str | None = None
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    tree_top_k: int = 1  # EAGLE, DFlash: children kept per expansion (1: chain drafting)
    tree_tokens: int = 16  # EAGLE, DFlash: nodes a tree keeps


MAX_SPECULATIVE_TOKENS = 16
TREE_DRAFTERS = ("eagle", "dflash")  # the methods that draft trees, each shaped by a section of its name
MAX_TREE_TOP_K = 16
MAX_TREE_TOKENS = 128


def _parse_draft_pairing_spec(spec: Any, path: str = "spec") -> DraftPairingSpec:
    _fields(spec, path, {"targetRef", "method", "source", "numSpeculativeTokens", "ngram", *TREE_DRAFTERS},
            {"targetRef", "method"})
    target = _check_type(spec["targetRef"], str, f"{path}.targetRef")
    method = _check_type(spec["method"], str, f"{path}.method")
    if method not in ("ngram", "draft", "eagle", "mtp", "dflash"):
        raise ManifestError(f'must be "ngram", "draft", "eagle", "mtp" or "dflash", got {shown(method)}',
                            f"{path}.method")
    source = spec.get("source")
    if source is not None:
        _check_type(source, str, f"{path}.source")
    if method == "mtp" and source is not None:
        raise ManifestError("method mtp drafts with the head the target's own checkpoint ships: it takes no source",
                            f"{path}.source")
    if method in ("draft", "eagle", "dflash") and not source:
        what = {"draft": "the draft model's", "eagle": "the EAGLE head's", "dflash": "the DFlash drafter's"}[method]
        raise ManifestError(f"method {method} needs {what} source", f"{path}.source")
    k = _positive_int(spec, "numSpeculativeTokens", path, 3)
    if k > MAX_SPECULATIVE_TOKENS:
        raise ManifestError(f"must be at most {MAX_SPECULATIVE_TOKENS}, got {shown(k)}", f"{path}.numSpeculativeTokens")
    ngram = _fields(spec.get("ngram", {}), f"{path}.ngram", {"min", "max"})
    n_min = _positive_int(ngram, "min", f"{path}.ngram", 1)
    n_max = _positive_int(ngram, "max", f"{path}.ngram", max(4, n_min))
    if n_max < n_min:
        raise ManifestError(f"must be at least ngram.min ({n_min}), got {shown(n_max)}", f"{path}.ngram.max")
    for section in TREE_DRAFTERS:
        if section in spec and method != section:
            raise ManifestError(f"only method {section} reads the {section} section", f"{path}.{section}")
    tree_path = f"{path}.{method}"
    tree = _fields(spec.get(method, {}) if method in TREE_DRAFTERS else {}, tree_path, {"topK", "treeTokens"})
    top_k = _positive_int(tree, "topK", tree_path, 1)
    if top_k > MAX_TREE_TOP_K:
        raise ManifestError(f"must be at most {MAX_TREE_TOP_K}, got {shown(top_k)}", f"{tree_path}.topK")
    tokens = _positive_int(tree, "treeTokens", tree_path, max(16, k))
    if not k <= tokens <= MAX_TREE_TOKENS:
        raise ManifestError(f"must be between numSpeculativeTokens ({k}) and {MAX_TREE_TOKENS}, got {shown(tokens)}",
                            f"{tree_path}.treeTokens")
    return DraftPairingSpec(target, method, source, k, n_min, n_max, top_k, tokens)


def _number(obj: dict, key: str, path: str, lo: float, hi: float, default: float | None) -> float | None:
    if key not in obj:
        return default
    value = _check_type(obj[key], (int, float), f"{path}.{key}")
    if not lo <= value <= hi:
        raise ManifestError(f"must be between {lo} and {hi}, got {shown(value)}", f"{path}.{key}")
    return float(value)


@dataclass(frozen=True)
class SpecPolicySpec:
    """Speculation policy for the Models its selector matches, hot-swapped between steps."""

    match_labels: dict[str, str]
    enabled: bool = True
    mode: str = "goodput"
    max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS
    disable_by_batch_size: int | None = None
    acceptance_rate_threshold: float = 0.0
    ema_alpha: float = 0.1
    probe_interval: int = 16

    def selects(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items())


SPEC_POLICY_MODES = ("static", "goodput")


def _parse_spec_policy_spec(spec: Any, path: str = "spec") -> SpecPolicySpec:
    _fields(spec, path, {"selector", "enabled", "mode", "maxSpeculativeTokens", "disableByBatchSize",
                         "acceptanceRateThreshold", "emaAlpha", "probeInterval"}, {"selector"})
    selector = _fields(spec["selector"], f"{path}.selector", {"matchLabels"})
    enabled = spec.get("enabled", True)
    _check_type(enabled, bool, f"{path}.enabled")
    mode = spec.get("mode", "goodput")
    if mode not in SPEC_POLICY_MODES:
        raise ManifestError(f"must be one of {', '.join(SPEC_POLICY_MODES)}, got {shown(mode)}", f"{path}.mode")
    max_k = _positive_int(spec, "maxSpeculativeTokens", path, MAX_SPECULATIVE_TOKENS)
    if max_k > MAX_SPECULATIVE_TOKENS:
        raise ManifestError(f"must be at most {MAX_SPECULATIVE_TOKENS}, got {shown(max_k)}",
                            f"{path}.maxSpeculativeTokens")
    alpha = _number(spec, "emaAlpha", path, 0.0, 1.0, 0.1)
    if alpha == 0.0:
        raise ManifestError("must be greater than 0", f"{path}.emaAlpha")
    return SpecPolicySpec(
        match_labels=_string_map(selector.get("matchLabels", {}), f"{path}.selector.matchLabels"),
        enabled=enabled, mode=mode, max_speculative_tokens=max_k,
        disable_by_batch_size=_positive_int(spec, "disableByBatchSize", path, None),
        acceptance_rate_threshold=_number(spec, "acceptanceRateThreshold", path, 0.0, 1.0, 0.0),
        ema_alpha=alpha, probe_interval=_positive_int(spec, "probeInterval", path, 16))


@dataclass(frozen=True)
class TopologyHost:
    name: str
    address: str
    rdma_devices: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TopologySpec:
    """Hosts a tensor- or pipeline-parallel Model is placed on, and how its ranks start."""

    backend: str
    hosts: tuple[TopologyHost, ...]
    tensor_parallel_size: int  # ranks in the group, whichever the split: rank 0 on hosts[0], the others placed on the rest
    launcher: str = "ssh"  # ssh: remote ranks through ssh (local ones directly); local: all on this machine
    port: int | None = None  # first rank's listening port (ranks use port + rank); None: free ports when local
    step_timeout_seconds: float = 60.0  # a step that takes longer means a rank hung
    threads_per_rank: int | None = None  # OMP/OpenBLAS threads per rank (ranks sharing a host)
    specd_command: str = "specd"  # the specd executable on remote hosts
    # tensor: every layer split across ranks; pipeline: each rank a slice of the layers; auto: the group times
    # a decode step under each over its own link before it serves, and keeps the faster
    parallelism: str = "tensor"


def _parse_topology_spec(spec: Any, path: str = "spec") -> TopologySpec:
    _fields(spec, path, {"backend", "hosts", "tensorParallelSize", "launcher", "port", "stepTimeoutSeconds",
                         "threadsPerRank", "specdCommand", "parallelism"}, {"backend", "hosts"})
    backend = _check_type(spec["backend"], str, f"{path}.backend")
    parallelism = spec.get("parallelism", "tensor")
    if parallelism not in PARALLELISM:
        raise ManifestError(f'must be "tensor", "pipeline" or "auto", got {shown(parallelism)}', f"{path}.parallelism")
    if backend not in ("jaccl", "ring"):
        raise ManifestError(f'must be "jaccl" or "ring", got {shown(backend)}', f"{path}.backend")
    launcher = spec.get("launcher", "ssh")
    if launcher not in ("ssh", "local"):
        raise ManifestError(f'must be "ssh" or "local", got {shown(launcher)}', f"{path}.launcher")
    hosts_raw = _check_type(spec["hosts"], list, f"{path}.hosts")
    if not hosts_raw:
        raise ManifestError("at least one host is required", f"{path}.hosts")
    hosts, names = [], set()
    for i, h in enumerate(hosts_raw):
        hp = f"{path}.hosts[{i}]"
        _fields(h, hp, {"name", "address", "rdmaDevices"}, {"name", "address"})
        name = _check_type(h["name"], str, f"{hp}.name")
        if name in names:
            raise ManifestError(f"duplicate host {shown(name)}", f"{hp}.name")
        names.add(name)
        hosts.append(TopologyHost(name, _check_type(h["address"], str, f"{hp}.address"),
                                  _string_map(h.get("rdmaDevices", {}), f"{hp}.rdmaDevices")))
    size = _positive_int(spec, "tensorParallelSize", path, len(hosts))
    if size > len(hosts):
        raise ManifestError(f"must be at most the number of hosts ({len(hosts)}), got {shown(size)}",
                            f"{path}.tensorParallelSize")
    port = _positive_int(spec, "port", path, None)
    if port is not None and port + size > 65536:
        raise ManifestError(f"ports {port}..{port + size - 1} do not fit below 65536", f"{path}.port")
    return TopologySpec(backend, tuple(hosts), size, launcher, port,
                        _number(spec, "stepTimeoutSeconds", path, 1.0, 3600.0, 60.0),
                        _positive_int(spec, "threadsPerRank", path, None),
                        _check_type(spec.get("specdCommand", "specd"), str, f"{path}.specdCommand"), parallelism)


SPEC_PARSERS: dict[str, Callable[[Any], Any]] = {
    "Model": _parse_model_spec,
    "DraftPairing": _parse_draft_pairing_spec,
    "SpecPolicy": _parse_spec_policy_spec,
    "Topology": _parse_topology_spec,
}


def _string_map(obj: Any, path: str) -> dict[str, str]:
    _check_type(obj, dict, path)
    for k, v in obj.items():
        _check_type(v, str, f"{path}.{k}")
    return dict(obj)


# Set by the server; accepted back (``get -o yaml | apply``), never taken from clients.
SERVER_METADATA = ("uid", "generation", "resourceVersion", "creationTimestamp")
SOURCE_ANNOTATION = "specd.dev/source-file"  # the watched manifest file that owns the object
# Annotations the daemon writes and clients do not, as Kubernetes keeps managedFields:
# a client's apply neither sets, changes nor removes them (nor does ``specd diff`` show them).
SERVER_ANNOTATIONS = frozenset({SOURCE_ANNOTATION})
KINDS_WITH_SOURCE = ("Model", "DraftPairing")


def _resolve_sources(kind: str, spec: Any, origin: str | None) -> Any:
    """Make a relative local ``source`` absolute, relative to the manifest's file,
    so the stored object means the same wherever the daemon runs."""
    if kind in KINDS_WITH_SOURCE and isinstance(spec, dict) and isinstance(spec.get("source"), str):
        return {**spec, "source": resolve_source(spec["source"], origin)}
    return spec


def parse_resource(doc: Any, origin: str | None = None) -> Resource:
    """Validate one YAML document into a Resource, or raise ManifestError."""
    try:
        _fields(doc, "", {"apiVersion", "kind", "metadata", "spec", "status"},
                {"apiVersion", "kind", "metadata", "spec"})
        if doc["apiVersion"] != API_VERSION:
            raise ManifestError(f'unsupported apiVersion {shown(doc["apiVersion"])} (expected {API_VERSION})',
                                "apiVersion")
        kind = doc["kind"]
        if not isinstance(kind, str) or kind not in SPEC_PARSERS:
            named = shown(kind) if isinstance(kind, str) else type(kind).__name__
            raise ManifestError(f'unknown kind {named} (known: {", ".join(sorted(SPEC_PARSERS))})', "kind")
        meta = _fields(doc["metadata"], "metadata", {"name", "labels", "annotations", *SERVER_METADATA},
                       {"name"})
        name = _check_type(meta["name"], str, "metadata.name")
        if not NAME_RE.fullmatch(name):
            raise ManifestError(
                f"invalid name {shown(name)}: a DNS-1123 label (at most 63 lower-case letters, digits "
                "and '-', starting and ending with a letter or digit)", "metadata.name")
        raw_spec = _resolve_sources(kind, doc["spec"], origin)
        version = meta.get("resourceVersion")
        return Resource(
            api_version=API_VERSION, kind=kind, name=name, spec=SPEC_PARSERS[kind](raw_spec),
            raw_spec=raw_spec,
            labels=_string_map(meta.get("labels", {}), "metadata.labels"),
            annotations=_string_map(meta.get("annotations", {}), "metadata.annotations"),
            origin=origin, resource_version=None if version is None else str(version))
    except ManifestError as err:
        raise ManifestError(err.reason, err.path, origin) from None


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounding the work a stream can ask for: at most
    MAX_ALIASES aliases, and at most MAX_EXPANDED_NODES nodes once every alias
    is expanded, since whatever walks the result (validation, an error that
    quotes a value, JSON for the admin API) walks the expansion, and aliases of
    aliases grow it exponentially. An alias inside its own anchor is refused."""

    aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise ManifestError(f"more than {MAX_ALIASES} YAML aliases")
        return super().compose_node(parent, index)

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node)
        return node


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for with its aliases expanded, counted
    once per distinct node (iteratively); ManifestError past MAX_EXPANDED_NODES
    or on a cycle."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = [n for pair in node.value for n in (pair if isinstance(pair, tuple) else (pair,))] \
            if isinstance(node, yaml.CollectionNode) else []
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = size = 1 + sum(sizes[id(c)] for c in children)
            if size > MAX_EXPANDED_NODES:
                raise ManifestError(f"the YAML expands to more than {MAX_EXPANDED_NODES} nodes once its aliases "
                                    "are expanded")
            continue
        if id(node) in on_path:
            raise ManifestError("a YAML alias refers to a node that contains it")
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def load_yaml(text: str, origin: str | None = None) -> list[Any]:
    """The documents of a YAML stream, bounded in size, aliases, expanded nodes
    and nesting, with no lone surrogate in any string (see ``api/text.py``)."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"larger than {MAX_MANIFEST_BYTES} bytes", "", origin)
    try:
        loader = _BoundedLoader(text)  # reads (and may refuse) the characters at once
        try:
            docs = []
            while loader.check_data():
                docs.append(loader.get_data())
        finally:
            loader.dispose()
    except ManifestError as err:
        raise ManifestError(err.reason, err.path, origin) from None
    except yaml.YAMLError as err:
        raise ManifestError(f"invalid YAML: {err}", "", origin) from None
    except RecursionError:
        raise ManifestError("invalid YAML: nested too deeply", "", origin) from None
    except ValueError as err:  # a scalar PyYAML cannot build: a 5,000-digit integer, a 13th month
        raise ManifestError(f"invalid YAML: {str(err)[:200]}", "", origin) from None
    docs = [d for d in docs if d is not None]
    for i, doc in enumerate(docs):
        path = lone_surrogate_path(doc, f"[{i}]" if len(docs) > 1 else "")
        if path is not None:
            raise ManifestError(LONE_SURROGATE, path, origin)
    return docs


def read_manifest_file(path: Path) -> str:
    """A manifest file's text; ManifestError (naming the file) if it cannot be read as UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError(f"not UTF-8 text (byte {err.start})", "", str(path)) from None
    except OSError as err:
        raise ManifestError(f"cannot read: {err.strerror or err}", "", str(path)) from None


def parse_documents(text: str, origin: str | None = None) -> list[Resource]:
    """Parse multi-document YAML; all documents are admitted or none."""
    docs = load_yaml(text, origin)
    resources = [parse_resource(d, origin) for d in docs]
    seen: set[tuple[str, str]] = set()
    for i, r in enumerate(resources):
        if (r.kind, r.name) in seen:
            raise ManifestError(f'duplicate {r.kind} "{r.name}"', f"[{i}].metadata.name", origin)
        seen.add((r.kind, r.name))
    return resources


def load_manifest_dir(directory: Path) -> list[Resource]:
    """Every resource in ``*.yaml``/``*.yml`` under ``directory`` (sorted, all-or-nothing)."""
    files = sorted(p for p in directory.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    resources: list[Resource] = []
    seen: dict[tuple[str, str], str] = {}
    for f in files:
        for r in parse_documents(read_manifest_file(f), str(f)):
            if (r.kind, r.name) in seen:
                raise ManifestError(f'{r.kind} "{r.name}" is also declared in {seen[r.kind, r.name]}',
                                    "metadata.name", str(f))
            seen[r.kind, r.name] = str(f)
            resources.append(r)
    return resources


def resolve_source(source: str, origin: str | None) -> str:
    """A local path (``/``, ``./``, ``../``, ``~``) is taken relative to the
    manifest's own file; anything else is a Hugging Face repo id."""
    if source.startswith(("./", "../")) and origin:
        return str((Path(origin).parent / source).resolve())
    if source.startswith("~"):
        try:
            return str(Path(source).expanduser())
        except RuntimeError as err:  # ~user that does not exist
            raise ManifestError(str(err), "spec.source") from None
    return source
