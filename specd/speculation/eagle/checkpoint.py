"""EAGLE heads in and out of the published checkpoint layouts (see docs/eagle.md).

A checkpoint is a directory (or a Hugging Face repo) with a ``config.json`` and
``*.safetensors`` weights named as the reference trainers write them:

* EAGLE-1 (SafeAILab ``cnets1.py``): ``fc`` over ``[embedding, hidden]`` (with a
  bias unless ``"bias": false``), ``layers.0.*`` without an input norm, and a
  copy of the target's ``embed_tokens.weight``.
* EAGLE-3 (SafeAILab ``cnets.py``, SpecForge, speculators): ``fc`` over three
  target layers, ``midlayer.*`` (``layers.0.*`` in the speculators format),
  ``norm``, ``lm_head`` over ``draft_vocab_size`` tokens, ``d2t`` (int64,
  ``target = draft + d2t[draft]``), ``t2d`` (bool over the target vocabulary)
  and often ``embed_tokens.weight``.

EagleHead's parameter names are the published ones, so mapping is limited to
the layer prefix; what the head takes from the target instead (the embedding)
or derives (``t2d``) is checked against the target and dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...core.loader import checkpoint_directory, materialize, read_tensors, text_config, vocab_size
from ...core.model_parts import decoder, final_norm
from .head import EagleConfig, EagleHead

EAGLE1_ARCHITECTURE = "LlamaForCausalLM"  # what SafeAILab's EAGLE-1 configs say
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # SpecForge / SGLang


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads when its config names none.

    EAGLE (``modeling_llama_kv.py``), SGLang and vLLM capture the *inputs* of
    layers 2, L//2 and L-3, i.e. the outputs of layers 1, L//2-1 and L-4 (the
    default SpecForge trains with)."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if not layers[0] < layers[1] < layers[2]:
        raise ValueError(f"a {num_layers}-layer target has no default EAGLE-3 feature layers {layers}: "
                         "name them in the checkpoint's eagle_config.eagle_aux_hidden_state_layer_ids")
    return layers


def load_head(source: str | Path, target: nn.Module) -> EagleHead:
    """Load an EAGLE-1 or EAGLE-3 head for ``target`` from a local directory or
    a hub repo id, checked tensor by tensor, cast to the target's dtype and
    frozen (``unfreeze()`` it to fine-tune)."""
    path = checkpoint_directory(str(source))
    config = _flat_config(json.loads((path / "config.json").read_text()))
    tensors = read_tensors(path)
    version = 3 if _is_eagle3(config, tensors) else 1
    head = EagleHead(_eagle_config(config, version, tensors, target, path))
    weights = _head_weights(head, tensors, target, path)
    head.load_weights(list(weights.items()))
    head.eval()
    head.freeze()
    materialize(head)
    return head


def save_head(head: EagleHead, out_dir: Path, target_config: dict | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` as the reference trainers
    publish them, so SGLang, vLLM and EAGLE load the head too.  ``target_config``
    (the target's config.json) contributes its token ids and is checked against
    the head's sizes."""
    c = head.config
    if list(c.feature_layers) != sorted(c.feature_layers):
        raise ValueError(f"feature layers {list(c.feature_layers)} are not in layer order, the order "
                         "published heads concatenate them in (reorder the fc columns to match)")
    if target_config is not None:
        for key, ours in (("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size)):
            if target_config.get(key) != ours:
                raise ValueError(f"the head has {key} {ours}, the target config {target_config.get(key)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _published_config(head, target_config or {})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out_dir / "model.safetensors"), _published_tensors(head), metadata={"format": "pt"})


# -- reading ------------------------------------------------------------------


def _flat_config(raw: dict) -> dict:
    """The speculators format nests the layer's config in ``transformer_layer_config``."""
    return {**raw.get("transformer_layer_config", {}), **raw}


def _is_eagle3(config: dict, tensors: dict) -> bool:
    return ("draft_vocab_size" in config
            or any("Eagle3" in a for a in config.get("architectures") or ())
            or any(n.startswith("midlayer.") for n in tensors))


def _eagle_config(config: dict, version: int, tensors: dict, target: nn.Module, path: Path) -> EagleConfig:
    hidden = text_config(target)["hidden_size"]
    for key, theirs in (("hidden_size", hidden), ("vocab_size", vocab_size(target))):
        if config.get(key) != theirs:
            raise ValueError(f"{path}: EAGLE-{version} head has {key} {config.get(key)}, the target {theirs}")
    if config.get("target_hidden_size", hidden) != hidden:
        raise ValueError(f"{path}: target_hidden_size {config['target_hidden_size']} is not the "
                         f"target's hidden_size {hidden}")
    _check_supported(config, path)
    rope = config.get("rope_parameters") or {}  # transformers >= 5 moves rope settings here
    rope_scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    fields = {
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "vocab_size": config["vocab_size"],
        "rms_norm_eps": config.get("rms_norm_eps"),
        "rope_theta": config.get("rope_theta", rope.get("rope_theta")),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "head_dim": config.get("head_dim"),
    }
    kwargs = {k: v for k, v in fields.items() if v is not None}
    if version == 1:
        return EagleConfig(version=1, fc_bias="fc.bias" in tensors, rope_scaling=rope_scaling, **kwargs)
    return EagleConfig(version=3, draft_vocab_size=config.get("draft_vocab_size"), rope_scaling=rope_scaling,
                       feature_layers=_feature_layers(config, len(decoder(target).layers), path),
                       fc_bias=False, **kwargs)


def _check_supported(config: dict, path: Path) -> None:
    """Variants that change the computation without adding tensors.  ``norm_output``
    means opposite things: SpecForge's (default on) norms the logits' input, the
    speculators' (default off) feeds normed outputs back while drafting."""
    speculators = "speculators_model_type" in config
    settings = {"num_hidden_layers": (config.get("num_hidden_layers", 1), 1),
                "hidden_act": (config.get("hidden_act", "silu"), "silu"),
                "norm_before_residual": (config.get("norm_before_residual", False), False),
                "norm_output": (config.get("norm_output", not speculators), not speculators),
                "eagle_config.use_aux_hidden_state":
                    ((config.get("eagle_config") or {}).get("use_aux_hidden_state", True), True)}
    for key, (value, supported) in settings.items():
        if value != supported:
            raise ValueError(f"{path}: {key} = {value!r} is not supported (only {supported!r})")


def _feature_layers(config: dict, num_layers: int, path: Path) -> tuple[int, ...]:
    """0-based target layers whose outputs the head fuses, in layer order.

    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge, SGLang) names
    layer outputs; a top-level ``eagle_aux_hidden_state_layer_ids``
    (speculators, vLLM) names layer inputs, one more.  Engines append captures
    as the layer loop passes them, so ``fc`` reads them in layer order."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        layers = [int(i) for i in nested]
    elif config.get("eagle_aux_hidden_state_layer_ids"):
        layers = [int(i) - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    else:
        return default_feature_layers(num_layers)
    if len(set(layers)) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"{path}: EAGLE-3 feature layers {layers} (outputs of 0-based layers) must be "
                         f"three distinct layers of the target's {num_layers}")
    return tuple(sorted(layers))


def _head_weights(head: EagleHead, tensors: dict[str, mx.array], target: nn.Module,
                  path: Path) -> dict[str, mx.array]:
    """Published tensors renamed to the head's parameters, every shape checked;
    the embedding copy and ``t2d`` are checked and dropped."""
    c = head.config
    expected = {name: a.shape for name, a in tree_flatten(head.parameters())}
    named = {_specd_name(name, c.version): (name, a) for name, a in tensors.items()}
    if len(named) != len(tensors):
        raise ValueError(f"{path} has the EAGLE-3 layer both as midlayer.* and as layers.0.*")
    _check_shape(named.pop("embed_tokens.weight", None), (c.vocab_size, c.hidden_size), path)
    t2d = named.pop("t2d", None) if c.version == 3 else None
    if c.version == 3 and "d2t" not in named and c.draft_vocab_size == c.vocab_size:
        named["d2t"] = ("d2t", mx.zeros((c.vocab_size,), dtype=mx.int64))  # the identity, often left out
    missing = sorted(expected.keys() - named.keys())
    unexpected = sorted(named[n][0] for n in named.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{path} is not an EAGLE-{c.version} head for this target: "
                         f"missing tensors {missing}, unexpected tensors {unexpected}")
    for name, shape in expected.items():
        _check_shape(named[name], shape, path)
    dtype = final_norm(target).weight.dtype
    weights = {name: a.astype(dtype) for name, (_, a) in named.items() if name != "d2t"}
    if c.version == 3:
        weights["d2t"] = _check_d2t(named["d2t"][1], t2d, c.vocab_size, path)
    return weights


def _specd_name(name: str, version: int) -> str:
    return "midlayer." + name.removeprefix("layers.0.") if version == 3 and name.startswith("layers.0.") else name


def _check_shape(entry: tuple[str, mx.array] | None, shape: tuple[int, ...], path: Path) -> None:
    if entry is not None and tuple(entry[1].shape) != tuple(shape):
        raise ValueError(f"{path}: tensor {entry[0]} has shape {tuple(entry[1].shape)}, expected {tuple(shape)}")


def _check_d2t(d2t: mx.array, t2d: tuple[str, mx.array] | None, vocab_size: int, path: Path) -> mx.array:
    """``d2t`` as int32 offsets, after checking it maps the draft vocabulary onto
    distinct target ids (and agrees with ``t2d`` where the checkpoint has one)."""
    if not mx.issubdtype(d2t.dtype, mx.integer):
        raise ValueError(f"{path}: d2t must hold integer offsets, not {d2t.dtype}")
    ids = np.arange(d2t.shape[0]) + np.array(d2t, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids):
        raise ValueError(f"{path}: d2t does not map the draft vocabulary onto distinct ids below {vocab_size}")
    if t2d is not None:
        _check_shape(t2d, (vocab_size,), path)
        mask = np.zeros(vocab_size, dtype=bool)
        mask[ids] = True
        if not np.array_equal(np.array(t2d[1]).astype(bool), mask):
            raise ValueError(f"{path}: t2d disagrees with d2t (t2d marks the target ids d2t maps to)")
    return d2t.astype(mx.int32)


# -- writing ------------------------------------------------------------------


def _published_config(head: EagleHead, target_config: dict) -> dict:
    c = head.config
    config = {
        "architectures": [EAGLE1_ARCHITECTURE if c.version == 1 else EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,  # SGLang would read the head's lm_head from the embedding
        "torch_dtype": str(head.fc.weight.dtype).rsplit(".", 1)[-1],
        **{k: target_config[k] for k in ("bos_token_id", "eos_token_id") if k in target_config},
    }
    if c.version == 1:
        config["bias"] = c.fc_bias
    else:
        config["draft_vocab_size"] = c.draft_vocab_size
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
                                  "use_aux_hidden_state": True}
    return config


def _published_tensors(head: EagleHead) -> dict[str, mx.array]:
    tensors = dict(tree_flatten(head.parameters()))
    if head.config.version == 3:
        d2t = tensors["d2t"].astype(mx.int64)
        t2d = mx.zeros((head.config.vocab_size,), dtype=mx.bool_)
        t2d[mx.arange(d2t.shape[0]) + d2t] = True
        tensors.update(d2t=d2t, t2d=t2d)
    return tensors
