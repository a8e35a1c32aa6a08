"""Pipeline parallelism: each rank holds a contiguous slice of the target's layers.

Tensor parallelism splits every layer and all-reduces twice per layer, which
needs a fast link (Thunderbolt 5 RDMA); a pipeline hands one hidden state per
forward from rank to rank, so it stands a slow one (Thunderbolt 4, Ethernet).
mlx-lm's convention is kept: rank ``size - 1`` runs the first layers and rank 0
the last, each receives the hidden state from the rank above and sends its own
down, and an ``all_gather`` at the end gives every rank rank 0's output, so
every rank computes the same logits and the group steps in lockstep exactly as
a tensor-parallel one does (speculation included).

A forward's hand-offs are evaluated before it returns (``EvaluatedInput`` on
the final norm, which every rank applies to the gathered state). Lazily, a
forward whose output nothing reads (a prefill chunk, where only the caches are
kept) would never send on the ranks above, whose caches do not depend on the
send, and the rank below would wait for it forever; evaluating each forward's
gathered state in program order keeps every rank's communication in one order.

Families whose decoder has mlx-lm's ``pipeline()`` use it. Others are split
here: the decoder keeps only its local layers, the first wrapped to receive and
the last to send and gather. That holds for decoders that run their layers in
order on one hidden state; a family that picks a layer's kind by its index
(sliding-window patterns, hybrid layer types) needs mlx-lm's own ``pipeline()``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..core.loader import materialize
from ..core.model_parts import FINAL_NORM_NAMES, decoder

# config.json keys that place layers of different kinds by index: the local slice would misplace them
INDEXED_LAYER_KEYS = ("layer_types", "sliding_window_pattern", "layers_block_type", "hybrid_override_pattern",
                      "full_attn_idxs", "block_types")


class StageEnd(nn.Module):
    """A local layer at an end of this rank's slice, with the hand-offs around it: the
    first receives the hidden state from the rank above, the last sends its output
    down and gathers the pipeline's output (rank 0's) onto every rank."""

    def __init__(self, layer: nn.Module, group: mx.distributed.Group, receive: bool, hand_off: bool):
        super().__init__()
        self.layer = layer
        self.group, self.receive, self.hand_off = group, receive, hand_off

    def __getattr__(self, name: str):
        """What the decoder reads of its layers (``use_sliding``, ``self_attn``, ...) is the layer's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "layer" not in self:
                raise
            return getattr(self["layer"], name)

    def __call__(self, h: mx.array, *args, **kwargs) -> mx.array:
        rank = self.group.rank()
        if self.receive:
            h = mx.distributed.recv_like(h, rank + 1, group=self.group)
        h = self.layer(h, *args, **kwargs)
        if self.hand_off:
            if rank != 0:
                h = mx.distributed.send(h, rank - 1, group=self.group)
            h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
        return h


class EvaluatedInput(nn.Module):
    """The decoder's final norm, evaluating the gathered hidden state it is given first."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def __call__(self, h: mx.array, *args, **kwargs) -> mx.array:
        mx.eval(h)
        return self.norm(h, *args, **kwargs)


def layer_range(layers: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s layers [start, end): an even split, the low ranks taking the extra
    layers, rank ``size - 1`` the first (mlx-lm's ``PipelineMixin`` splits the same way)."""
    base, extra = divmod(layers, size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(split[rank + 1:])
    return start, start + split[rank]


def split_layers(model: nn.Module, group: mx.distributed.Group) -> None:
    """Keep this rank's slice of the decoder's layers, with the hand-offs at its ends."""
    inner = decoder(model)
    rank, size = group.rank(), group.size()
    start, end = layer_range(len(inner.layers), rank, size)
    local = list(inner.layers[start:end])
    if len(local) == 1:
        local[0] = StageEnd(local[0], group, receive=rank < size - 1, hand_off=True)
    else:
        local[0] = StageEnd(local[0], group, receive=rank < size - 1, hand_off=False)
        local[-1] = StageEnd(local[-1], group, receive=False, hand_off=True)
    inner.layers = local


def load_stage(path: str, group: mx.distributed.Group) -> tuple[nn.Module, object, str]:
    """This rank's stage of the checkpoint at ``path``: only its layers' weights are read.
    Returns the model, its tokenizer, and how it was split (``pipeline()`` or ``layers``)."""
    from mlx_lm.utils import load_model, load_tokenizer

    config = json.loads((Path(path) / "config.json").read_text())
    model, _ = load_model(Path(path), lazy=True)  # weights read at materialize: only the kept layers'
    inner = decoder(model)
    if len(inner.layers) < group.size():
        raise ValueError(f"{len(inner.layers)} layers cannot be split over {group.size()} ranks")
    if hasattr(inner, "pipeline"):
        inner.pipeline(group)
        how = "pipeline()"
    else:
        text = config.get("text_config", config)
        indexed = [k for k in INDEXED_LAYER_KEYS if k in text]
        if indexed:
            other = ("serve it with parallelism: tensor" if hasattr(model, "shard")
                     else "nor shard(), so no split can take it")
            raise ValueError(f"{config.get('model_type')} places layers by index ({', '.join(indexed)}) and its "
                             f"mlx-lm model has no pipeline(): {other}")
        split_layers(model, group)
        how = "layers"
    norm = next(n for n in FINAL_NORM_NAMES if getattr(inner, n, None) is not None)
    setattr(inner, norm, EvaluatedInput(getattr(inner, norm)))
    materialize(model)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every stage loaded
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, how

