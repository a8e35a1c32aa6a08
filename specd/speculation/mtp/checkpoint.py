"""Reading the MTP head a target's checkpoint ships (the weights mlx-lm's ``sanitize`` drops).

The nextn layout (DeepSeek V3/V3.2, GLM-4.5 and later): ``num_nextn_predict_layers``
in config.json, and ``model.layers.{num_hidden_layers}.*`` holding ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, the decoder layer's own weights
(``self_attn``, ``mlp``, its two norms), and copies of the embedding and the LM
head (``embed_tokens``, ``shared_head.head``), which the head takes from the
target instead. The weights may sit in any of the checkpoint's safetensors
files (the forge writes them to ``mtp.safetensors``, which ``mlx_lm.load``
does not read, so a family whose ``sanitize`` keeps an extra layer still
loads). The decoder layer is of the family's last layer's kind (a MoE layer,
where the family has them): it is built as a copy of that layer, and its
weights go through the family's own ``sanitize`` under that layer's index
(experts stacked, FP8 dequantized, as the main layers' are).

Qwen3-Next and Qwen3.5 ship theirs in another layout (``mtp.*``,
``mtp_num_hidden_layers``): refused, with that reason, until specd reads it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import dequantize_model

from ...core.cache import kv_bytes, runs_row_by_row
from ...core.loader import checkpoint_directory, materialize, read_tensors, text_config, with_text_config
from ...core.model_parts import decoder
from .head import MTPHead

# the head's own weights in the nextn layout: checkpoint name -> the head's parameter
OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "shared_head.norm.weight": "norm.weight"}
COPIES = ("embed_tokens.", "shared_head.head.")  # the target's own embedding and head, repeated


class NoMTPHead(ValueError):
    """The checkpoint carries no MTP head specd can run: the message says why."""


def load_mtp_head(source: str, target: nn.Module) -> MTPHead:
    """The MTP head of the checkpoint ``target`` was loaded from (a directory or a hub repo id)."""
    path = checkpoint_directory(source)
    config = with_text_config(json.loads((path / "config.json").read_text()))
    family = config.get("model_type")
    depth = config.get("num_nextn_predict_layers") or 0
    if not depth:
        if config.get("mtp_num_hidden_layers"):  # Qwen3-Next and Qwen3.5 name theirs so
            raise NoMTPHead(f"{source} ships an MTP head in the mtp.* layout of {family}, which specd does not "
                            "read yet (it reads the nextn layout: num_nextn_predict_layers)")
        raise NoMTPHead(f"{source} ships no MTP head: its config.json has no num_nextn_predict_layers")
    if runs_row_by_row(target):
        raise NoMTPHead(f"{source}: specd runs {family}'s rows one by one (its attention reads back the keys it "
                        "stores, or its rows cannot batch), and an MTP head drafts for a batch")
    if not isinstance(make_prompt_cache(target)[-1], (KVCache, RotatingKVCache)):
        raise NoMTPHead(f"{source}: {family}'s last layer is not an attention layer, and an MTP head is one "
                        "(specd builds it as the last layer's kind)")
    last = config["num_hidden_layers"]
    prefix = f"model.layers.{last}."
    tensors = read_tensors(path, lambda name: name.startswith(prefix))
    if not tensors:
        raise NoMTPHead(f"{source} says num_nextn_predict_layers={depth} but holds no {prefix}* weights (a "
                        "conversion dropped them: mlx_lm.convert does; serve the original checkpoint, or "
                        "copy its MTP weights into this one)")
    return _head(tensors, prefix, target, config, Path(path))


def _head(tensors: dict[str, mx.array], prefix: str, target: nn.Module, config: dict, path: Path) -> MTPHead:
    layers = decoder(target).layers
    stand_in = len(layers) - 1  # the MTP layer is built, and sanitized, as one of the last layer's kind
    named = {name[len(prefix):]: array for name, array in tensors.items()}
    # the rest is the decoder layer's (attention, MLP or MoE, the family's norms): a strict load checks it
    layer_weights = {f"model.layers.{stand_in}.{n}": a for n, a in named.items()
                     if n not in OWN and not n.startswith(COPIES)}
    if hasattr(target, "sanitize"):
        layer_weights = target.sanitize(layer_weights)
    inner = f"model.layers.{stand_in}."
    weights = {f"layer.{n[len(inner):]}": a for n, a in layer_weights.items() if n.startswith(inner)}
    missing = [n for n in OWN if n not in named]
    if missing:
        raise NoMTPHead(f"{path}: the MTP head lacks {', '.join(prefix + n for n in missing)}")
    weights.update({OWN[n]: named[n] for n in OWN})
    # the family's layer, whatever its constructor takes; quantized as the MTP weights are, not the target
    layer = dequantize_model(copy.deepcopy(layers[stand_in]))
    text = text_config(target)
    head = MTPHead(layer, text["hidden_size"], text.get("rms_norm_eps", 1e-6), 0)
    quantization = config.get("quantization")
    if quantization is not None and any(n.endswith(".scales") for n in weights):
        nn.quantize(head, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"),
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise NoMTPHead(f"{path}: the MTP weights do not fit a {text_config(target).get('model_type')} "
                        f"layer: {exc}") from None
    dtype = next(a.dtype for _, a in tree_flatten(decoder(target).layers[0].parameters()))
    head.set_dtype(dtype, lambda t: mx.issubdtype(t, mx.floating))
    head.eval()
    head.freeze()
    materialize(head)
    head.row_bytes = kv_bytes(_Probe(head))[0]
    return head


class _Probe(nn.Module):
    """The head as a one-layer model over token ids, so ``kv_bytes`` reads its cache's width."""

    def __init__(self, head: MTPHead):
        super().__init__()
        self.head = head
        self.layers = [head.layer]

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        x = mx.zeros((*tokens.shape, self.head.hidden_size))
        return self.head(x, x, cache[0])
