"""Train a DFlash block drafter for a local target, in MLX, and write it as z-lab publishes them.

The target stays frozen: each batch runs it once, with a ``FeatureCapture`` of
the layers the drafter reads, for its features and logits. Every few
positions of a window is an anchor: the drafter sees the target's context
before the anchor and the block ``[anchor token, mask, ..]`` at the anchor's
positions, and learns the target's own distribution of each following
token (soft cross-entropy against the target's logits, as the EAGLE and MTP
heads are trained), nearer positions weighing more (DFlash's decaying
position weights: a chain is accepted from its first token on). All of a
window's blocks run in one forward: each attends to the context before its
own anchor and to itself.

Validation (held-out text) reports what speculation will see: per position,
how often the drafter's argmax is the target's, and the mean accepted length
of the block's greedy chain against the target's greedy continuation, with
the target's own next token first (the bonus token) as while serving.
"""

from __future__ import annotations

import argparse
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
from mlx_lm.models.cache import make_prompt_cache

from ..core.loader import materialize, text_config, vocab_size
from ..core.model_parts import decoder, target_parts
from ..speculation.dflash.checkpoint import save_dflash
from ..speculation.dflash.drafter import DFlashConfig, DFlashDrafter
from ..speculation.eagle.capture import FeatureCapture
from .eagle import (VAL_WINDOWS, Log, _soft_ce, head_training, read_corpus, split_tokens, target_pass,
                    train_and_validate)
from .train import add_training_arguments, windows

DEFAULTS = {"steps": 700, "seq_len": 128, "batch": 8, "lr": 4e-3, "layers": 2, "block_size": 8, "anchor_every": 4}
POSITION_DECAY = 0.7  # the weight of block position j + 1 against position j
VAL_ANCHORS = 4


def feature_layers_for(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` target layers spread from the second to the last (the published drafters read
    layers spread over the target, from layer 1 on)."""
    return tuple(sorted({int(i) for i in np.round(np.linspace(1, num_layers - 1, count))}))


def fresh_drafter(model: nn.Module, layers: int = DEFAULTS["layers"], block_size: int = DEFAULTS["block_size"],
                  seed: int = 0, config: dict | None = None) -> DFlashDrafter:
    """A drafter shaped like ``model``'s layers (its attention heads and MLP width), with ``layers``
    layers, weights drawn N(0, 1/fan_in) and unit norms; the mask token is the target's padding token
    (``config``: its config.json), else its end of text."""
    text = text_config(model)
    config = config or {}
    eos = config.get("eos_token_id")
    mask = config.get("pad_token_id")
    if mask is None:
        mask = (eos[0] if isinstance(eos, list) else eos) or 0
    heads = text["num_attention_heads"]
    target_layers = len(decoder(model).layers)
    drafter = DFlashDrafter(DFlashConfig(
        hidden_size=text["hidden_size"], num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads, intermediate_size=text["intermediate_size"],
        vocab_size=vocab_size(model), block_size=block_size,
        target_layer_ids=feature_layers_for(target_layers), mask_token_id=int(mask),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=text.get("rope_theta", 10000.0),
        rope_scaling=text.get("rope_scaling"), max_position_embeddings=text.get("max_position_embeddings", 4096),
        num_target_layers=target_layers))
    params = tree_flatten(drafter.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    drafter.update(tree_unflatten([(n, mx.ones(p.shape) if p.ndim < 2 else
                                    mx.random.normal(p.shape, key=k) / math.sqrt(p.shape[-1]))
                                   for k, (n, p) in zip(keys, params)]))
    materialize(drafter)
    return drafter


def block_logits(drafter: DFlashDrafter, features: mx.array, first: mx.array, anchors: np.ndarray,
                 embed: nn.Module, lm_head) -> mx.array:
    """The drafter's logits (B, A, block - 1, V) for blocks at ``anchors`` (A,): block a starts with
    the embedding ``first[:, a]`` and sees the context ``features`` (B, T, ...) before its anchor."""
    B, T = features.shape[:2]
    A, n, c = len(anchors), drafter.block_size, drafter.config
    masks = mx.broadcast_to(embed(mx.array([[c.mask_token_id]])).astype(first.dtype), (B, A, n - 1, c.hidden_size))
    block = mx.concatenate([first[:, :, None], masks], axis=2).reshape(B * A, n, -1)
    offset = mx.array(np.tile(anchors, B))
    visible = np.arange(T)[None, None, :] < anchors[:, None, None]  # (A, 1, T): the context before each anchor
    own = np.tril(np.ones((n, n), dtype=bool)) if c.is_causal else np.ones((n, n), dtype=bool)
    mask = np.concatenate([np.broadcast_to(visible, (A, n, T)), np.broadcast_to(own, (A, n, n))], axis=-1)
    mask = mx.array(np.tile(mask, (B, 1, 1))[:, None])  # (B * A, 1, n, T + n)
    attends = []
    for layer, (keys, values) in zip(drafter.layers, drafter.context_keys_values(drafter.fuse(features), 0)):
        keys, values = mx.repeat(keys, A, axis=0), mx.repeat(values, A, axis=0)
        attends.append(lambda q, k, v, keys=keys, values=values, scale=layer.self_attn.scale:
                       mx.fast.scaled_dot_product_attention(q, mx.concatenate([keys, k], axis=2),
                                                            mx.concatenate([values, v], axis=2), scale=scale,
                                                            mask=mask))
    out = drafter(block, offset, attends)[:, 1:]
    return drafter.logits(out, lm_head).reshape(B, A, n - 1, -1)


def dflash_loss(embed: nn.Module, lm_head, anchor_every: int):
    """Position-weighted soft cross-entropy of every block's drafts against the target's distributions."""

    def loss(drafter: DFlashDrafter, feats: mx.array, embeds: mx.array, logits: mx.array) -> mx.array:
        n, T = drafter.block_size, feats.shape[1]
        anchors = np.arange(1, T - n + 2, anchor_every)
        drafted = block_logits(drafter, feats, embeds[:, mx.array(anchors)], anchors, embed, lm_head)
        # block position j (1..n-1) drafts token anchor + j, which the target predicts at anchor + j - 1
        wanted = mx.softmax(logits[:, mx.array(anchors[:, None] + np.arange(n - 1)[None, :])], axis=-1)
        weights = mx.array(POSITION_DECAY ** np.arange(n - 1), dtype=mx.float32)
        return (_soft_ce(drafted, wanted) * weights).sum(-1).mean() / weights.sum()

    return loss


def accepted_lengths(drafter: DFlashDrafter, model: nn.Module, capture: FeatureCapture, embed: nn.Module,
                     lm_head, prefix: mx.array) -> tuple[mx.array, mx.array]:
    """For each row of ``prefix`` (B, P): how many of the block's greedy drafts match the target's
    greedy continuation after its own next token, and which positions matched (B, block - 1)."""
    cache = make_prompt_cache(model)
    logits = model(prefix, cache=cache)
    features = capture.take().astype(mx.float32)
    greedy = [mx.argmax(logits[:, -1], axis=-1)]
    for _ in range(drafter.block_size - 1):
        greedy.append(mx.argmax(model(greedy[-1][:, None], cache=cache)[:, -1], axis=-1))
    capture.take()  # the continuation's features are not the drafter's context
    P = prefix.shape[1]
    first = embed(greedy[0][:, None]).astype(mx.float32)
    drafts = mx.argmax(block_logits(drafter, features, first, np.array([P]), embed, lm_head)[:, 0], axis=-1)
    match = drafts == mx.stack(greedy[1:], axis=1)
    return mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1), match


def validate(drafter: DFlashDrafter, model: nn.Module, capture: FeatureCapture, loss_fn, val: np.ndarray,
             batch: int) -> dict:
    """Loss, per-position agreement with the target's greedy continuation, and the mean accepted
    length of greedy blocks from ``VAL_ANCHORS`` prefix lengths per window."""
    embed, lm_head = target_parts(model)
    losses, accepted, matches = [], [], []
    seq = val.shape[1]
    prefixes = np.linspace(seq // 4, seq - 1, VAL_ANCHORS).astype(int)
    for i in range(0, len(val), batch):
        w = mx.array(val[i: i + batch])
        losses.append(loss_fn(drafter, *target_pass(model, capture, embed, w)).item())
        for p in prefixes:
            n, match = accepted_lengths(drafter, model, capture, embed, lm_head, w[:, :p])
            accepted.append(np.array(n))
            matches.append(np.array(match))
    accepted_all = np.concatenate(accepted)
    return {
        "loss": round(float(np.mean(losses)), 4),
        "agreement_by_position": [round(float(a), 4) for a in np.concatenate(matches).mean(axis=0)],
        "mean_accepted": round(float(accepted_all.mean()), 4),
        "block_size": drafter.block_size,
        "blocks": int(accepted_all.size),
    }


def train_dflash(target: Path, out: Path, corpus: list[Path] | None = None, steps: int = DEFAULTS["steps"],
                 budget_s: float | None = None, seq_len: int = DEFAULTS["seq_len"], batch: int = DEFAULTS["batch"],
                 lr: float = DEFAULTS["lr"], layers: int = DEFAULTS["layers"],
                 block_size: int = DEFAULTS["block_size"], anchor_every: int = DEFAULTS["anchor_every"],
                 seed: int = 0, log: Log = print) -> dict:
    """Train a drafter for the target at ``target`` and write it (``save_dflash``) and ``train.json``
    to ``out``; returns what ``train.json`` holds."""
    start = time.monotonic()
    mx.random.seed(seed)
    model, tokenizer, config = mlx_lm.load(str(target), return_config=True)
    model.freeze()
    train_data, val_data = split_tokens(tokenizer, read_corpus(corpus))
    val = windows(val_data, seq_len - 1, VAL_WINDOWS)
    drafter = fresh_drafter(model, layers, block_size, seed, config)
    capture = FeatureCapture(model, drafter.feature_layers)
    embed, lm_head = target_parts(model)
    loss_fn = dflash_loss(embed, lm_head, anchor_every)
    log(f"train-dflash: {layers}-layer drafter, block {block_size}, reading target layers "
        f"{list(drafter.feature_layers)} of {target}")
    cfg = head_training(steps, budget_s, lr, batch, seq_len)
    losses, n, seconds, metrics = train_and_validate(drafter, model, capture, loss_fn, train_data, val, cfg, seed,
                                                     log, validate, "train-dflash")
    save_dflash(drafter, out, target_config=config)
    info = {"target": str(target), "steps": n, "train_seconds": round(seconds, 1),
            "seconds": round(time.monotonic() - start, 1),
            "args": {"corpus": [str(p) for p in corpus or []] or "stdlib", "steps": steps, "budget_s": budget_s,
                     "seq_len": seq_len, "batch": batch, "lr": lr, "layers": layers, "block_size": block_size,
                     "anchor_every": anchor_every, "seed": seed},
            "feature_layers": list(drafter.feature_layers),
            "losses": {"first": round(float(np.mean(losses[:10])), 4),
                       "final": round(float(np.mean(losses[-50:])), 4)},
            "validation": metrics}
    (Path(out) / "train.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"train-dflash: wrote {out} in {info['seconds']:.0f}s: loss {info['losses']['first']:.3f} -> "
        f"{info['losses']['final']:.3f}, mean accepted {metrics['mean_accepted']:.2f} of {block_size - 1}")
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``specd train-dflash``'s arguments."""
    parser.add_argument("--target", type=Path, required=True, help="local mlx-lm target model directory")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the drafter into")
    add_training_arguments(parser, DEFAULTS, ("steps", "seq_len", "batch", "layers", "block_size", "anchor_every"))


def run(args: argparse.Namespace) -> int:
    info = train_dflash(args.target, args.out, args.corpus, args.steps, args.budget_s, args.seq_len, args.batch,
                        args.lr, args.layers, args.block_size, args.anchor_every, args.seed,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps({"out": str(args.out), "steps": info["steps"], **info["validation"]}))
    return 0
