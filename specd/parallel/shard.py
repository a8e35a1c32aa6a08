"""This rank's part of the target: a shard of every layer (tensor parallelism), a slice of the
layers (pipeline parallelism), or, for ``parallelism: auto``, whichever of the two decodes faster
on this group's own Macs and link.

Which split wins depends on two figures no manifest knows: a step's time on these Macs and the
link's latency as the group's collectives see it (``docs/tensor-parallel.md``). So ``auto`` does
not estimate them: before serving, the group loads each split in turn, times the same decode
steps through it over its own link, and keeps the faster. Every rank reads rank 0's timings, so
the ranks choose alike. A split the model cannot take (no ``shard()``, or layers placed by index
without ``pipeline()``) is left out with its reason.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx
import structlog
from mlx_lm.models.cache import make_prompt_cache

from ..core.loader import materialize, resolve_source
from ..core.model_parts import decoder
from .pipeline import load_stage

log = structlog.get_logger(__name__)
SPLITS = ("tensor", "pipeline")
PROBE_PROMPT_TOKENS = 32  # the context the timed steps decode after
PROBE_WARMUP_STEPS = 2
PROBE_STEPS = 12  # timed decode steps per split; the median counts


@dataclass(frozen=True)
class Split:
    """How the group split the target, and for ``auto`` what decided it."""

    parallelism: str
    step_seconds: dict[str, float] = field(default_factory=dict)  # each probed split's median decode step
    refused: dict[str, str] = field(default_factory=dict)  # the splits the model cannot take, and why

    def as_dict(self) -> dict:
        return {"parallelism": self.parallelism,
                "probe": {"stepMilliseconds": {s: round(t * 1000, 3) for s, t in self.step_seconds.items()},
                          "refused": self.refused} if self.step_seconds or self.refused else None}


def load_shard(source: str, revision: str | None, group: mx.distributed.Group, parallelism: str,
               backend: str = "ring"):
    """The target split as ``parallelism`` says (``tensor``, ``pipeline`` or ``auto``): the model,
    its tokenizer, and the ``Split``. A hub source (at a revision) is fetched whole first:
    mlx-lm's sharded load takes no revision."""
    from mlx_lm.utils import _download

    path = resolve_source(source) if revision is None else str(_download(resolve_source(source), revision))
    if parallelism != "auto":
        return (*_load(path, group, parallelism), Split(parallelism))
    return _load_fastest(path, group, backend)


def _load(path: str, group: mx.distributed.Group, parallelism: str):
    from mlx_lm.utils import sharded_load

    if parallelism == "pipeline":
        model, tokenizer, how = load_stage(path, group)
        log.info("pipeline stage", split=how, layers=sum(layer is not None for layer in decoder(model).layers))
        return model, tokenizer
    model, tokenizer = sharded_load(path, tensor_group=group)
    materialize(model)
    return model, tokenizer


def _load_fastest(path: str, group: mx.distributed.Group, backend: str):
    """Load and time each split, keep the faster. The one likelier to win over this backend is
    probed last, so it is usually kept loaded; the other is loaded again only if it won. One
    split's shards are held at a time."""
    order = SPLITS if backend == "ring" else SPLITS[::-1]
    seconds, refused, loaded = {}, {}, None
    for parallelism in order:
        loaded = None
        gc.collect()
        mx.clear_cache()
        try:  # a split the model cannot take is refused alike on every rank (it reads the same config)
            model, tokenizer = _load(path, group, parallelism)
        except ValueError as exc:
            refused[parallelism] = str(exc)
            continue
        seconds[parallelism] = decode_step_seconds(model, group)
        loaded = (parallelism, model, tokenizer)
        del model, tokenizer  # ``loaded`` holds the only reference, dropped before the next load
    if not seconds:
        raise ValueError("neither split can take this model: "
                         + "; ".join(f"{split}: {why}" for split, why in refused.items()))
    fastest = min(seconds, key=seconds.get)
    log.info("split chosen", parallelism=fastest, step_ms={s: round(t * 1000, 3) for s, t in seconds.items()})
    if loaded is None or loaded[0] != fastest:
        loaded = None
        gc.collect()
        mx.clear_cache()
        loaded = (fastest, *_load(path, group, fastest))
    return loaded[1], loaded[2], Split(fastest, seconds, refused)


def decode_step_seconds(model, group: mx.distributed.Group) -> float:
    """The median time of one row's decode step through the split ``model``, its collectives
    over the group's link included: rank 0's figure, on every rank."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, PROBE_PROMPT_TOKENS), mx.int32), cache=cache))
    token = mx.zeros((1, 1), mx.int32)
    times = []
    for step in range(PROBE_WARMUP_STEPS + PROBE_STEPS):
        started = time.perf_counter()
        mx.eval(model(token, cache=cache))
        if step >= PROBE_WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    mine = statistics.median(times) if group.rank() == 0 else 0.0
    return float(mx.distributed.all_sum(mx.array(mine, dtype=mx.float32), group=group, stream=mx.cpu).item())
