"""Give a local target an MTP head in its checkpoint, as DeepSeek V3 and GLM-4.5 ship theirs.

The head (``speculation.mtp.head``) is written in the nextn layout
(``model.layers.{num_hidden_layers}.*``, ``num_nextn_predict_layers: 1`` in
config.json; or Qwen3-Next's ``mtp.*``), to ``mtp.safetensors``, which ``mlx_lm.load`` does not read: the
target still loads as before, and ``method: mtp`` finds the head.

Fresh heads (the tests': parity holds whatever a head proposes) copy the
target's last attention layer, re-drawn. ``train_mtp`` trains one against the frozen
target on the forge's corpus, as the EAGLE heads are trained (``forge.eagle``):
the head reads the target's normed hidden state at t and the embedding of
token t+1, and learns the target's own distribution over token t+2 (soft
cross-entropy), so acceptance is real.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..core.loader import materialize, text_config, with_text_config
from ..core.model_parts import decoder, target_parts
from ..speculation.eagle.capture import FeatureCapture
from ..speculation.mtp.checkpoint import NEXTN, Layout, attention_layer, swap_halves
from ..speculation.mtp.head import MTPHead
from .eagle import (VAL_WINDOWS, Log, _soft_ce, head_training, read_corpus, split_tokens, train_and_validate,
                    validate)
from .train import add_training_arguments, windows

WEIGHTS_FILE = "mtp.safetensors"
DEFAULTS = {"steps": 400, "seq_len": 128, "batch": 8, "lr": 3e-3}


def fresh_head(model: nn.Module, seed: int = 0) -> MTPHead:
    """An MTP head shaped for ``model``: a copy of its last attention layer with matrices re-drawn
    N(0, 1/fan_in), unit norms and a random ``eh_proj``."""
    layer = copy.deepcopy(decoder(model).layers[attention_layer(model)])
    text = text_config(model)
    head = MTPHead(layer, text["hidden_size"], text.get("rms_norm_eps", 1e-6))
    params = tree_flatten(head.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    # vectors (norm scales, biases) keep the target's values, as copies of their own: an array
    # deep-copied from the target still aliases it inside a compiled training step
    drawn = [(name, mx.array(np.array(p)) if p.ndim < 2
              else mx.random.normal(p.shape, key=key) / math.sqrt(p.shape[-1])) for key, (name, p) in zip(keys, params)]
    head.update(tree_unflatten(drawn))
    head.unfreeze()
    materialize(head)  # the copied layer's arrays that are not parameters too (RoPE frequencies)
    return head


def save_mtp_head(head: MTPHead, target_dir: Path, layout: Layout = NEXTN) -> None:
    """Write ``head`` into the checkpoint at ``target_dir`` in ``layout`` (as MLX holds its layer:
    a family's ``sanitize`` leaves such weights as they are)."""
    config_path = target_dir / "config.json"
    config = json.loads(config_path.read_text())
    prefix = layout.prefix(with_text_config(config))
    names = {mine: theirs for theirs, mine in layout.own.items()}
    weights = {prefix + (names.get(n) or layout.layer + n.removeprefix("layer.")): a
               for n, a in tree_flatten(head.parameters())}
    if layout.hidden_first:
        projection = prefix + names["eh_proj.weight"]
        weights[projection] = swap_halves(weights[projection])
    mx.save_safetensors(str(target_dir / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    index = target_dir / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint's index names every file
        data = json.loads(index.read_text())
        data["weight_map"].update({n: WEIGHTS_FILE for n in weights})
        index.write_text(json.dumps(data, indent=2) + "\n")
    config[layout.depth_key] = 1
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def mtp_loss(lm_head):
    """Soft cross-entropy of the head's draft of token t+2 against the target's distribution."""

    def loss(head: MTPHead, feats: mx.array, embeds: mx.array, logits: mx.array) -> mx.array:
        out = head(feats[:, :-1], embeds[:, 1:])
        return _soft_ce(head.logits(out, lm_head), mx.softmax(logits[:, 1:], axis=-1)).mean()

    return loss


def train_mtp(target: Path, steps: int = DEFAULTS["steps"], budget_s: float | None = None,
              seq_len: int = DEFAULTS["seq_len"], batch: int = DEFAULTS["batch"], lr: float = DEFAULTS["lr"],
              seed: int = 0, corpus: list[Path] | None = None, log: Log = print) -> dict:
    """Train an MTP head for the target at ``target`` and write it into that checkpoint, with
    ``mtp-train.json``; returns what that file holds."""
    start = time.monotonic()
    mx.random.seed(seed)
    model, tokenizer = mlx_lm.load(str(target))
    model.freeze()
    train_data, val_data = split_tokens(tokenizer, read_corpus(corpus))
    val = windows(val_data, seq_len - 1, VAL_WINDOWS)
    head = fresh_head(model, seed)
    capture = FeatureCapture(model)
    loss_fn = mtp_loss(target_parts(model)[1])
    cfg = head_training(steps, budget_s, lr, batch, seq_len)
    losses, n, seconds, metrics = train_and_validate(head, model, capture, loss_fn, train_data, val, cfg, seed, log,
                                                     validate, "train-mtp")
    save_mtp_head(head, Path(target))
    info = {"target": str(target), "steps": n, "train_seconds": round(seconds, 1),
            "seconds": round(time.monotonic() - start, 1),
            "args": {"steps": steps, "budget_s": budget_s, "seq_len": seq_len, "batch": batch, "lr": lr,
                     "seed": seed},
            "losses": {"first": round(float(np.mean(losses[:10])), 4),
                       "final": round(float(np.mean(losses[-50:])), 4)},
            "validation": metrics}
    (Path(target) / "mtp-train.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"train-mtp: wrote {Path(target) / WEIGHTS_FILE} in {info['seconds']:.0f}s: loss "
        f"{info['losses']['first']:.3f} -> {info['losses']['final']:.3f}, top-1 agreement "
        f"{metrics['top1_agreement']:.3f}, mean accepted {metrics['mean_accepted']:.2f} of {metrics['chain_depth']}")
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``specd train-mtp``'s arguments."""
    parser.add_argument("--target", type=Path, required=True,
                        help="local mlx-lm target directory; the head is written into it")
    add_training_arguments(parser, DEFAULTS, ("steps", "seq_len", "batch"))


def run(args: argparse.Namespace) -> int:
    info = train_mtp(args.target, args.steps, args.budget_s, args.seq_len, args.batch, args.lr, args.seed,
                     args.corpus, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps({"target": info["target"], "steps": info["steps"], **info["validation"]}))
    return 0
