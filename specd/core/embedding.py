"""Sentence embeddings from a decoder checkpoint (the Qwen3-Embedding kind).

The model runs without its LM head: its decoder's final hidden states are
pooled as the checkpoint's sentence-transformers configuration says
(``modules.json`` and its Pooling module's ``config.json``), then normalized
when the pipeline ends in a Normalize module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .model_parts import decoder

# sentence-transformers' pooling_mode_* flags specd implements (one per checkpoint)
POOLING_MODES = ("lasttoken", "mean_tokens", "cls_token", "max_tokens")
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class Pooling:
    mode: str = "lasttoken"
    normalize: bool = True


def read_pooling(model_dir: Path) -> Pooling:
    """The checkpoint's pooling. Without ``modules.json``: last-token pooling,
    normalized (what decoder embedding checkpoints use)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    types = [m.get("type") for m in modules]
    pooling = next((m for m in modules if m.get("type") == ST_POOLING), None)
    if pooling is None:
        raise ValueError(f"{modules_file} has no {ST_POOLING} module")
    config = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
    chosen = [key.removeprefix("pooling_mode_") for key, on in config.items()
              if key.startswith("pooling_mode_") and on is True]
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise ValueError(f"pooling {chosen} is not supported: specd pools with exactly one of "
                         f"{', '.join(POOLING_MODES)}")
    return Pooling(chosen[0], ST_NORMALIZE in types)


def hidden_states(model: nn.Module, tokens: mx.array, cache: list | None = None) -> mx.array:
    """The decoder's final (normed) hidden states: the model less its LM head."""
    return decoder(model)(tokens, cache=cache).astype(mx.float32)


def _finish(pooled: mx.array, pooling: Pooling) -> mx.array:
    if not pooling.normalize:
        return pooled
    return pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def embed_rows(model: nn.Module, rows: list[list[int]], pooling: Pooling) -> mx.array:
    """One forward over right-padded rows, ``[len(rows), hidden]``.

    Attention is causal, so a real token never sees the padding after it:
    each row's states are those of the row alone."""
    lengths = mx.array([len(r) for r in rows])
    width = max(len(r) for r in rows)
    tokens = mx.array([r + [0] * (width - len(r)) for r in rows])
    states = hidden_states(model, tokens)
    real = (mx.arange(width)[None, :] < lengths[:, None])[..., None]
    if pooling.mode == "lasttoken":
        pooled = mx.take_along_axis(states, (lengths - 1)[:, None, None], axis=1)[:, 0]
    elif pooling.mode == "cls_token":
        pooled = states[:, 0]
    elif pooling.mode == "mean_tokens":
        pooled = mx.where(real, states, 0).sum(axis=1) / lengths[:, None]
    else:
        pooled = mx.where(real, states, -mx.inf).max(axis=1)
    return _finish(pooled, pooling)


def embed_long(model: nn.Module, row: list[int], pooling: Pooling, chunk: int) -> mx.array:
    """One row in chunks of ``chunk`` tokens over a KV cache, ``[1, hidden]``:
    memory bounded by the chunk, not by the row's length squared."""
    cache = make_prompt_cache(model)
    total = None
    for start in range(0, len(row), chunk):
        states = hidden_states(model, mx.array([row[start:start + chunk]]), cache)[0]
        if pooling.mode == "lasttoken":
            total = states[-1]
        elif pooling.mode == "cls_token":
            total = states[0] if total is None else total
        elif pooling.mode == "mean_tokens":
            total = states.sum(axis=0) + (0 if total is None else total)
        else:
            total = states.max(axis=0) if total is None else mx.maximum(total, states.max(axis=0))
        mx.eval(total, [c.state for c in cache])
    if pooling.mode == "mean_tokens":
        total = total / len(row)
    return _finish(total[None], pooling)
