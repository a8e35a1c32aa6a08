"""Reading the MTP head a target's checkpoint ships (the weights mlx-lm's ``sanitize`` drops).

Two layouts, each named by its config.json:

* nextn (DeepSeek V3/V3.2, GLM-4.5 and later: ``num_nextn_predict_layers``):
  ``model.layers.{num_hidden_layers}.*`` holds ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.norm``, the decoder layer's own weights, and copies of the
  embedding and the LM head (``embed_tokens``, ``shared_head.head``), which the
  head takes from the target instead.
* mtp (Qwen3-Next, Qwen3.5: ``mtp_num_hidden_layers``): ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``
  and ``mtp.norm``.
* MiMo (``num_nextn_predict_layers`` too): ``model.mtp_layers.0.*``, its own
  weights ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` (over the
  hidden state *then* the embedding, the other way round from DeepSeek's) and
  ``final_layernorm`` beside the layer's. Only the first depth is read; the head
  is chained past it.

The weights may sit in any of the checkpoint's safetensors files (the forge
writes them to ``mtp.safetensors``, which ``mlx_lm.load`` does not read, so a
family whose ``sanitize`` keeps an extra layer still loads). The decoder layer
is an attention layer of the family's own kind (a MoE layer where the family
has them): it is built as a copy of the target's last attention layer, and its
weights go through the family's own ``sanitize`` under that layer's name
(experts stacked, FP8 dequantized, zero-centred norms shifted, as the main
layers' are); the head's own norms are stored as its layer's, and shifted alike.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import dequantize_model

from ...core.cache import runs_row_by_row
from ...core.loader import checkpoint_directory, materialize, read_tensors, text_config, with_text_config
from ...core.model_parts import decoder
from .head import MTPHead


@dataclass(frozen=True)
class Layout:
    """Where a checkpoint keeps its MTP head."""

    depth_key: str  # the config.json field that says how deep the head is
    own: dict[str, str]  # the head's own weights: checkpoint name (under the prefix) -> the head's parameter
    layer: str  # the decoder layer's weights, under the prefix
    base: str  # the head's weights: "{layers}" stands for num_hidden_layers
    copies: tuple[str, ...] = ()  # the target's own embedding and LM head, repeated
    hidden_first: bool = False  # the projection reads [hidden state, embedding], not [embedding, hidden state]

    def prefix(self, config: dict) -> str:
        return self.base.format(layers=config.get("num_hidden_layers"))


NEXTN = Layout("num_nextn_predict_layers", {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                                            "eh_proj.weight": "eh_proj.weight",
                                            "shared_head.norm.weight": "norm.weight"},
               "", "model.layers.{layers}.", ("embed_tokens.", "shared_head.head."))
QWEN3_NEXT = Layout("mtp_num_hidden_layers", {"pre_fc_norm_embedding.weight": "enorm.weight",
                                              "pre_fc_norm_hidden.weight": "hnorm.weight", "fc.weight": "eh_proj.weight",
                                              "norm.weight": "norm.weight"}, "layers.0.", "mtp.")
MIMO = Layout("num_nextn_predict_layers", {"token_layernorm.weight": "enorm.weight",
                                           "hidden_layernorm.weight": "hnorm.weight", "input_proj.weight": "eh_proj.weight",
                                           "final_layernorm.weight": "norm.weight"}, "", "model.mtp_layers.0.",
              hidden_first=True)
LAYOUTS = (NEXTN, QWEN3_NEXT, MIMO)


class NoMTPHead(ValueError):
    """The checkpoint carries no MTP head specd can run: the message says why."""


def load_mtp_head(source: str, target: nn.Module) -> MTPHead:
    """The MTP head of the checkpoint ``target`` was loaded from (a directory or a hub repo id)."""
    path = checkpoint_directory(source)
    config = with_text_config(json.loads((path / "config.json").read_text()))
    family = config.get("model_type")
    named = [layout for layout in LAYOUTS if config.get(layout.depth_key)]
    if not named:
        raise NoMTPHead(f"{source} ships no MTP head: its config.json has no "
                        + " or ".join(dict.fromkeys(layout.depth_key for layout in LAYOUTS)))
    if runs_row_by_row(target):
        raise NoMTPHead(f"{source}: specd runs {family}'s rows one by one (its attention reads back the keys it "
                        "stores, or its rows cannot batch), and an MTP head drafts for a batch")
    stand_in = attention_layer(target)
    for layout in named:
        prefix = layout.prefix(config)
        tensors = read_tensors(path, lambda name: name.startswith(prefix))
        if tensors:
            weights = {name[len(prefix):]: array for name, array in tensors.items()}
            return _head(weights, layout, target, stand_in, config, Path(path))
    raise NoMTPHead(f"{source} says {named[0].depth_key}={config[named[0].depth_key]} but holds no "
                    f"{' or '.join(layout.prefix(config) + '*' for layout in named)} weights (a conversion dropped "
                    "them: mlx_lm.convert does; serve the original checkpoint, or copy its MTP weights into this one)")


def attention_layer(target: nn.Module) -> int:
    """The index of the target's last attention layer: the kind an MTP head's layer is."""
    kinds = make_prompt_cache(target)
    index = next((i for i in reversed(range(len(kinds))) if isinstance(kinds[i], (KVCache, RotatingKVCache))), None)
    if index is None:
        raise NoMTPHead(f"{text_config(target).get('model_type')} has no layer of attention alone, the kind an "
                        "MTP head's layer is")
    return index


def _head(named: dict[str, mx.array], layout: Layout, target: nn.Module, stand_in: int, config: dict,
          path: Path) -> MTPHead:
    missing = [n for n in layout.own if n not in named]
    if missing:
        raise NoMTPHead(f"{path}: the MTP head lacks {', '.join(missing)}")
    # the rest is the decoder layer's (attention, MLP or MoE, the family's norms): a strict load checks it
    inner = _layer_path(target, stand_in)
    raw = {inner + n[len(layout.layer):]: a for n, a in named.items()
           if n not in layout.own and n.startswith(layout.layer) and not n.startswith(layout.copies)}
    layer_weights = target.sanitize(dict(raw)) if hasattr(target, "sanitize") else raw
    weights = {f"layer.{n[len(inner):]}": a for n, a in layer_weights.items() if n.startswith(inner)}
    shift = _norm_shift(raw, layer_weights)
    weights.update({mine: named[theirs] + shift if shift and mine.endswith("norm.weight") else named[theirs]
                    for theirs, mine in layout.own.items()})
    if layout.hidden_first:
        weights["eh_proj.weight"] = swap_halves(weights["eh_proj.weight"])
    # the family's layer, whatever its constructor takes; quantized as the MTP weights are, not the target
    layer = dequantize_model(copy.deepcopy(decoder(target).layers[stand_in]))
    text = text_config(target)
    head = MTPHead(layer, text["hidden_size"], text.get("rms_norm_eps", 1e-6))
    quantization = config.get("quantization")
    if quantization is not None and any(n.endswith(".scales") for n in weights):
        nn.quantize(head, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"),
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise NoMTPHead(f"{path}: the MTP weights do not fit a {text.get('model_type')} layer: {exc}") from None
    dtype = next(a.dtype for _, a in tree_flatten(decoder(target).layers[0].parameters()))
    head.set_dtype(dtype, lambda t: mx.issubdtype(t, mx.floating))
    head.eval()
    head.freeze()
    materialize(head)
    return head


def _layer_path(target: nn.Module, index: int) -> str:
    """Where the target's own weights keep decoder layer ``index`` (``model.layers.3.``, or a
    multimodal checkpoint's ``language_model.model.layers.3.``): the names its ``sanitize`` knows."""
    marker = f"layers.{index}."
    name = next(n for n, _ in tree_flatten(target.parameters()) if marker in n)
    return name[: name.index(marker) + len(marker)]


def swap_halves(projection: mx.array) -> mx.array:
    """A projection over [a, b] as one over [b, a] (its own inverse)."""
    half = projection.shape[-1] // 2
    return mx.concatenate([projection[..., half:], projection[..., :half]], axis=-1)


def _norm_shift(raw: dict[str, mx.array], sanitized: dict[str, mx.array]) -> float:
    """What the family's ``sanitize`` added to the layer's norm scales (1 for a checkpoint of
    zero-centred norms, Qwen3-Next's as published; 0 otherwise): the head's own norms get the same."""
    name = next((n for n in raw if n.endswith("input_layernorm.weight")), None)
    if name is None or name not in sanitized:
        return 0.0
    return round(float((sanitized[name] - raw[name]).mean().item()))

