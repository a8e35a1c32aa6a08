"""DFlash drafters in and out of z-lab's published checkpoint layout.

A checkpoint (``z-lab/Qwen3-8B-DFlash-b16`` and its siblings) is a directory
or a hub repo with a ``config.json`` whose architecture is
``DFlashDraftModel`` and whose ``dflash_config`` names the target layers the
drafter reads (``target_layer_ids``, 0-based decoder layers: their outputs)
and the mask token; ``block_size`` is the block it was trained to fill. Its
safetensors hold ``fc``, ``hidden_norm``, ``layers.{i}.*`` (a Qwen3 decoder
layer each) and ``norm``; the embedding and the LM head are the target's.

What changes the computation without adding tensors, and is not implemented
(sliding-window layers, DFlash2's convolutions and candidate selector, logit
scaling), is refused by name rather than drafted wrongly.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...core.loader import checkpoint_directory, materialize, read_tensors, text_config, vocab_size
from ...core.model_parts import decoder, final_norm
from .drafter import DFlashConfig, DFlashDrafter

ARCHITECTURE = "DFlashDraftModel"
# settings whose published defaults are the only ones implemented, with those defaults
DEFAULT_ONLY = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0,
                "attention_bias": False, "hidden_act": "silu"}


def load_dflash(source: str | Path, target: nn.Module) -> DFlashDrafter:
    """Load a DFlash drafter for ``target`` from a local directory or a hub repo id, checked against
    the target tensor by tensor, cast to its dtype and frozen."""
    path = checkpoint_directory(str(source))
    config = dflash_config(json.loads((path / "config.json").read_text()), target, path)
    drafter = DFlashDrafter(config)
    drafter.load_weights(list(_weights(drafter, read_tensors(path), target, path).items()))
    drafter.eval()
    drafter.freeze()
    materialize(drafter)
    return drafter


def dflash_config(raw: dict, target: nn.Module, path: Path | str) -> DFlashConfig:
    """The drafter's shape from its config.json, or a ValueError naming what does not fit ``target``."""
    architecture = (raw.get("architectures") or [None])[0]
    if architecture != ARCHITECTURE:
        raise ValueError(f"{path}: architecture {architecture!r} is not a DFlash drafter this version runs "
                         f"(only {ARCHITECTURE}: DFlash2's convolutions and candidate selector are not implemented)")
    nested = raw.get("dflash_config") or {}

    def value(name: str, default=None):
        return nested.get(name, raw.get(name, default))

    for name, supported in DEFAULT_ONLY.items():
        if value(name, supported) != supported:
            raise ValueError(f"{path}: {name} = {value(name)!r} is not supported (only {supported!r})")
    layer_types = set(raw.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"{path}: layer_types {sorted(layer_types)}: only full_attention layers are supported "
                         "(sliding-window DFlash layers are not implemented)")
    text = text_config(target)
    layers = len(decoder(target).layers)
    ids = value("target_layer_ids")
    mask = value("mask_token_id")
    if not ids or mask is None:
        raise ValueError(f"{path}: dflash_config must name target_layer_ids and mask_token_id")
    ids = tuple(int(i) for i in ids)
    if list(ids) != sorted(set(ids)) or not all(0 <= i < layers for i in ids):
        raise ValueError(f"{path}: target_layer_ids {list(ids)} are not distinct layers of the target's {layers}, "
                         "in order")
    recorded = value("num_target_layers")
    if recorded is not None and int(recorded) != layers:
        raise ValueError(f"{path}: the drafter was trained for a {recorded}-layer target, this one has {layers}")
    vocab = vocab_size(target)
    for key, theirs in (("hidden_size", text["hidden_size"]), ("vocab_size", vocab)):
        if raw.get(key) != theirs:
            raise ValueError(f"{path}: the drafter has {key} {raw.get(key)}, the target {theirs}")
    if not 0 <= int(mask) < vocab:
        raise ValueError(f"{path}: mask_token_id {mask} is outside the target's vocabulary of {vocab}")
    rope = raw.get("rope_parameters") or {}  # transformers >= 5 keeps rope settings here
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    heads = raw["num_attention_heads"]
    return DFlashConfig(
        hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, intermediate_size=raw["intermediate_size"],
        vocab_size=vocab, block_size=int(value("block_size", 16)), target_layer_ids=ids, mask_token_id=int(mask),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling, max_position_embeddings=raw.get("max_position_embeddings", 40960),
        is_causal=bool(raw.get("is_causal") or False), num_target_layers=layers)


def _weights(drafter: DFlashDrafter, tensors: dict[str, mx.array], target: nn.Module,
             path: Path) -> dict[str, mx.array]:
    """The checkpoint's tensors, every name and shape checked, in the target's dtype (copies of the
    target's embedding or LM head, which the drafter reads from the target, are dropped)."""
    expected = {name: a.shape for name, a in tree_flatten(drafter.parameters())}
    shared = {"embed_tokens.weight", "lm_head.weight"}
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys() - shared)
    if missing or unexpected:
        raise ValueError(f"{path} is not a DFlash drafter of this shape: missing tensors {missing}, "
                         f"unexpected tensors {unexpected}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}")
    dtype = final_norm(target).weight.dtype
    return {name: tensors[name].astype(dtype) for name in expected}


def save_dflash(drafter: DFlashDrafter, out_dir: Path, target_config: dict | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` as z-lab publishes them (token ids from the
    target's ``target_config``)."""
    c = drafter.config
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "attention_bias": False,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "is_causal": c.is_causal,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "torch_dtype": str(drafter.fc.weight.dtype).rsplit(".", 1)[-1],
        **{k: (target_config or {})[k] for k in ("bos_token_id", "eos_token_id") if k in (target_config or {})},
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(drafter.parameters())),
                        metadata={"format": "pt"})
