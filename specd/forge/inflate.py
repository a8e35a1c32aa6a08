"""Function-preserving inflation: a memory-bound copy of a trained target.

Tiny models on a CPU are dispatch-bound: a draft's step costs about what the
target's does (c follows layer counts), so drafting cannot pay, while real
deployments pair a target whose step is dominated by reading its weights
with a draft 10-30x cheaper.  Widening every MLP of the trained target with
extra units whose output weights are zero reproduces that cost profile: each
step really reads (and multiplies) all the new weights, yet the model
computes the same function, so acceptance rates stay those of the real pair.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from .llama import TOKENIZER_FILES

INFLATION_FILE = "inflation.json"


def inflate(src: Path, dst: Path, intermediate_size: int, seed: int = 0) -> dict:
    """Write ``dst``: ``src`` with every MLP widened to ``intermediate_size``.

    New gate/up rows are random (so the work is real); the matching
    down-projection columns are zero (so the output is unchanged).
    """
    config = json.loads((src / "config.json").read_text())
    old = config["intermediate_size"]
    if intermediate_size <= old:
        raise ValueError(f"intermediate_size must exceed the model's {old}")
    weights = mx.load(str(src / "model.safetensors"))
    key = mx.random.key(seed)
    extra = intermediate_size - old
    for name in sorted(weights):
        w = weights[name]
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            key, sub = mx.random.split(key)
            noise = 0.02 * mx.random.normal((extra, w.shape[1]), dtype=w.dtype, key=sub)
            weights[name] = mx.concatenate([w, noise], axis=0)
        elif name.endswith("mlp.down_proj.weight"):
            weights[name] = mx.concatenate([w, mx.zeros((w.shape[0], extra), dtype=w.dtype)], axis=1)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    config["intermediate_size"] = intermediate_size
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, dst / name)
    params = sum(w.size for w in weights.values())
    info = {"inflated_from": str(src), "intermediate_size": [old, intermediate_size], "params": params,
            "weight_bytes": sum(w.nbytes for w in weights.values()), "function_preserving": True}
    (dst / INFLATION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info
