"""Train an EAGLE head (EAGLE-1 or EAGLE-3) for a local mlx-lm target, in MLX.

The target stays frozen: each batch runs it once, with a ``FeatureCapture``,
for its features ``f`` and logits, and the head learns on the pairs
``(f_t, embedding of x_{t+1})`` whose output should stand for ``f_{t+1}`` and
so predict the target's distribution over ``x_{t+2}``.

* EAGLE-1 (as in the EAGLE paper): smooth-L1 regression of the output onto
  ``f_{t+1}`` plus 0.1 x the cross-entropy of its logits (the target's own LM
  head) against the target's distribution at ``t+1``.
* EAGLE-3: cross-entropy against the target's distribution only, over the
  draft vocabulary, at two "training-time test" steps.  Step 1 reads the
  fused target features; step 2 reads, at position ``s``, the head's own step-1
  output from ``s - 1``, and attends to step 1's keys before ``s`` and to
  itself: exactly what a depth-1 draft node sees while serving.  Step 2 weighs
  0.8, as in EAGLE-3 (which runs seven such steps; two keep it cheap here).

Validation (held-out text) reports what speculation will see: the head's
top-1 agreement with the target's argmax one step ahead, and the mean
accepted length of a greedy 4-token chain the head drafts from its own
outputs, against the target's greedy continuation.

The corpus defaults to the forge's (the standard library's sources, on which
the demo models were trained), split the forge's way: every 20th file held out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..speculation.eagle.capture import FeatureCapture
from ..speculation.eagle.checkpoint import default_feature_layers, save_head
from ..core.model_parts import final_norm, target_parts
from ..speculation.eagle.head import EagleConfig, EagleHead
from .tokenizer import stdlib_sources
from .train import TrainConfig, encode_corpus, lr_at, windows

Log = Callable[[str], None]
Loss = Callable[[EagleHead, mx.array, mx.array, mx.array], mx.array]

VAL_EVERY = 20  # the forge's held-out stride: the demo target never saw these files
VAL_WINDOWS = 64
CHAIN_DEPTH = 4
TTT_WEIGHT = 0.8
DEFAULTS = {"steps": 400, "seq_len": 128, "batch": 8, "lr": 6e-3}


def read_corpus(paths: list[Path] | None) -> list[str]:
    """The texts of ``paths`` (files, or every file under a directory, sorted),
    or, without paths, the forge's standard-library corpus."""
    if not paths:
        return [text for _, text in stdlib_sources()]
    files = [f for p in paths for f in (sorted(q for q in p.rglob("*") if q.is_file())
                                        if p.is_dir() else [p])]
    texts = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(text)
    if not texts:
        raise ValueError(f"no UTF-8 text in {', '.join(map(str, paths))}")
    return texts


def split_tokens(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Training and validation token streams: every 20th text is held out, or
    with fewer texts than that, the stream's last twentieth."""
    tok, eos = tokenizer.backend_tokenizer, tokenizer.eos_token_id
    if len(texts) >= VAL_EVERY:
        held = [t for i, t in enumerate(texts) if i % VAL_EVERY == 0]
        kept = [t for i, t in enumerate(texts) if i % VAL_EVERY != 0]
        return encode_corpus(tok, kept, eos), encode_corpus(tok, held, eos)
    data = encode_corpus(tok, texts, eos)
    cut = len(data) - len(data) // VAL_EVERY
    return data[:cut], data[cut:]


def feature_layers_for(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high target layers: the published ones, or for
    targets too shallow for those, three evenly spread (the last included)."""
    try:
        return default_feature_layers(num_layers)
    except ValueError:
        return tuple(int(i) for i in np.round(np.linspace(0, num_layers - 1, 3)))


def frequent_tokens(data: np.ndarray, vocab_size: int, n: int) -> mx.array:
    """EAGLE-3's draft vocabulary: the ``n`` most frequent tokens of ``data``
    (ties to the lower id), as ``d2t`` offsets (``target = draft + d2t[draft]``)."""
    counts = np.bincount(data, minlength=vocab_size)
    ids = np.sort(np.argsort(-counts, kind="stable")[:n])
    return mx.array(ids - np.arange(n), dtype=mx.int32)


def build_head(config: dict, version: int, data: np.ndarray, draft_vocab: int | None,
               model: nn.Module) -> EagleHead:
    """A fresh head shaped like the target (EAGLE-3: its draft vocabulary, and
    its LM head and norm started from the target's rows, so that an output
    equal to the target's last hidden state already gives the target's logits)."""
    vocab = config["vocab_size"]
    cfg = EagleConfig(
        version=version,
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=vocab,
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=config.get("rope_theta", 10000.0),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        head_dim=config.get("head_dim"),
        draft_vocab_size=draft_vocab if version == 3 else None,
        feature_layers=feature_layers_for(config["num_hidden_layers"]) if version == 3 else (),
        fc_bias=version == 1,
    )
    head = EagleHead(cfg)
    if version == 3:
        head.d2t = frequent_tokens(data, vocab, cfg.draft_vocab_size)
        ids = mx.arange(cfg.draft_vocab_size) + head.d2t
        _, lm_head = target_parts(model)
        rows = lm_head(mx.eye(cfg.hidden_size, dtype=mx.float32)).T  # any head: tied, quantized
        head.lm_head.weight = rows[ids].astype(mx.float32)
        # A copy: an array shared with the target would alias it inside the compiled step.
        head.norm.weight = mx.array(np.array(final_norm(model).weight.astype(mx.float32)))
        head.freeze(recurse=False, keys=["d2t"])
    mx.eval(head.parameters())
    return head


def target_pass(model: nn.Module, capture: FeatureCapture, embed: nn.Module,
                tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The frozen target's features, token embeddings and logits, in float32."""
    logits = model(tokens)
    feats = capture.take()
    out = (feats, embed(tokens), logits)
    return tuple(mx.stop_gradient(a.astype(mx.float32)) for a in out)


def _soft_ce(logits: mx.array, probs: mx.array) -> mx.array:
    """Cross-entropy of ``logits`` against soft labels ``probs``, per position."""
    return -(probs * (logits - mx.logsumexp(logits, axis=-1, keepdims=True))).sum(-1)


def eagle1_loss(lm_head) -> Loss:
    """EAGLE-1: smooth-L1 onto ``f_{t+1}`` plus 0.1 x soft cross-entropy."""

    def loss(head: EagleHead, feats: mx.array, embeds: mx.array, logits: mx.array) -> mx.array:
        out = head(feats[:, :-1], embeds[:, 1:])
        regression = nn.losses.smooth_l1_loss(out, feats[:, 1:])
        return regression + 0.1 * _soft_ce(lm_head(out), mx.softmax(logits[:, 1:], axis=-1)).mean()

    return loss


def two_steps(head: EagleHead, hidden: mx.array, embeds: mx.array) -> tuple[mx.array, mx.array]:
    """The head's outputs at training-time-test steps 1 and 2 (see the module
    docstring); step 2 at position 0 has no step-1 output to read and is junk."""
    layer = head.layer
    attn = layer.self_attn
    x1, residual1 = head._inputs(hidden, embeds)
    q1, k1, v1 = attn.project(x1, 0)
    out1 = layer.finish(attn.attend(q1, k1, v1, "causal"), residual1)
    shifted = mx.concatenate([hidden[:, :1], out1[:, :-1]], axis=1)
    x2, residual2 = head._inputs(shifted, embeds)
    q2, k2, v2 = attn.project(x2, 0)
    n = hidden.shape[1]
    pos = mx.arange(n)
    mask = mx.concatenate([pos[None, :] < pos[:, None], pos[None, :] == pos[:, None]], axis=1)
    keys, values = mx.concatenate([k1, k2], axis=2), mx.concatenate([v1, v2], axis=2)
    return out1, layer.finish(attn.attend(q2, keys, values, mask), residual2)


def eagle3_loss(head: EagleHead, feats: mx.array, embeds: mx.array, logits: mx.array) -> mx.array:
    """EAGLE-3: soft cross-entropy over the draft vocabulary at both steps."""
    ids = mx.arange(head.config.draft_vocab_size) + head.d2t
    probs = mx.take(mx.softmax(logits[:, 1:], axis=-1), ids, axis=-1)
    out1, out2 = two_steps(head, head.fuse(feats[:, :-1]), embeds[:, 1:])
    ce1 = _soft_ce(head.lm_head(head.norm(out1)), probs).mean()
    ce2 = _soft_ce(head.lm_head(head.norm(out2[:, 1:])), probs[:, 1:]).mean()
    return ce1 + TTT_WEIGHT * ce2


def accepted_lengths(head: EagleHead, model: nn.Module, capture: FeatureCapture, embed: nn.Module,
                     lm_head, prefix: mx.array) -> mx.array:
    """How many of the head's greedy chain of ``CHAIN_DEPTH`` tokens after
    ``prefix`` (B, P) match the target's greedy continuation, per row.

    As while serving, the target's own next token (the bonus token) comes
    first and the head drafts after it.
    """
    cache = make_prompt_cache(model)
    logits = model(prefix, cache=cache)
    hidden = head.fuse(capture.take().astype(mx.float32))
    greedy = [mx.argmax(logits[:, -1], axis=-1)]
    for _ in range(CHAIN_DEPTH):
        greedy.append(mx.argmax(model(greedy[-1][:, None], cache=cache)[:, -1], axis=-1))
    embeds = embed(mx.concatenate([prefix[:, 1:], greedy[0][:, None]], axis=1)).astype(mx.float32)
    drafts = []
    for _ in range(CHAIN_DEPTH):
        out = head(hidden, embeds)[:, -1:]
        drafts.append(mx.argmax(head.logits(out, lm_head)[:, -1], axis=-1))
        hidden = mx.concatenate([hidden, out], axis=1)
        embeds = mx.concatenate([embeds, embed(drafts[-1][:, None]).astype(mx.float32)], axis=1)
    match = mx.stack(drafts, axis=1) == mx.stack(greedy[1:], axis=1)
    return mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1)


def validate(head: EagleHead, model: nn.Module, capture: FeatureCapture, loss_fn: Loss,
             val: np.ndarray, batch: int) -> dict:
    """Loss, top-1 agreement with the target one step ahead, and the mean
    accepted length of greedy chains from four prefix lengths per window."""
    embed, lm_head = target_parts(model)
    losses, agree, accepted = [], [], []
    seq = val.shape[1]
    prefixes = np.linspace(seq // 4, seq - CHAIN_DEPTH - 1, 4).astype(int)
    for i in range(0, len(val), batch):
        w = mx.array(val[i : i + batch])
        feats, embeds, logits = target_pass(model, capture, embed, w)
        losses.append(loss_fn(head, feats, embeds, logits).item())
        out = head(head.fuse(feats[:, :-1]), embeds[:, 1:])
        pred = mx.argmax(head.logits(out, lm_head), axis=-1)
        agree.append(np.array(pred == mx.argmax(logits[:, 1:], axis=-1)))
        for p in prefixes:
            accepted.append(np.array(accepted_lengths(head, model, capture, embed, lm_head, w[:, :p])))
    accepted_all = np.concatenate(accepted)
    return {
        "loss": round(float(np.mean(losses)), 4),
        "top1_agreement": round(float(np.concatenate(agree).mean()), 4),
        "mean_accepted": round(float(accepted_all.mean()), 4),
        "chain_depth": CHAIN_DEPTH,
        "chains": int(accepted_all.size),
        "positions": int(val.shape[0] * (seq - 1)),
    }


def train_eagle(target: Path, out: Path, version: int = 1, corpus: list[Path] | None = None,
                steps: int = DEFAULTS["steps"], budget_s: float | None = None,
                seq_len: int = DEFAULTS["seq_len"], batch: int = DEFAULTS["batch"],
                lr: float = DEFAULTS["lr"], draft_vocab: int | None = None, seed: int = 0,
                log: Log = print) -> tuple[EagleHead, dict]:
    """Train a head for ``target`` and write it (``save_head``) and
    ``train.json`` to ``out``; returns the head and what ``train.json`` holds.

    Steps stop at ``steps`` or when ``budget_s`` is spent; the schedule (the
    forge's warmup + cosine) runs on the larger progress fraction, so runs
    that the step count binds are reproducible per seed.
    """
    start = time.monotonic()
    mx.random.seed(seed)
    model, tokenizer, config = mlx_lm.load(str(target), return_config=True)
    model.freeze()
    train_data, val_data = split_tokens(tokenizer, read_corpus(corpus))
    if len(val_data) <= seq_len:
        raise ValueError(f"{len(val_data)} held-out tokens are too few for --seq-len {seq_len}")
    val = windows(val_data, seq_len - 1, VAL_WINDOWS)
    head = build_head(config, version, train_data, draft_vocab, model)
    capture = FeatureCapture(model, head.config.feature_layers)
    loss_fn = eagle1_loss(target_parts(model)[1]) if version == 1 else eagle3_loss
    log(f"train-eagle: EAGLE-{version} head for {target}: {len(train_data)} training tokens, "
        f"{val.size} validation tokens")
    cfg = head_training(steps, budget_s, lr, batch, seq_len)
    losses, n, seconds, metrics = train_and_validate(head, model, capture, loss_fn, train_data, val, cfg, seed, log,
                                                     validate)
    save_head(head, out, target_config=config)
    info = {
        "target": str(target),
        "version": version,
        "args": {"corpus": [str(p) for p in corpus or []] or "stdlib", "steps": steps,
                 "budget_s": budget_s, "seq_len": seq_len, "batch": batch, "lr": lr,
                 "draft_vocab": draft_vocab, "seed": seed},
        "feature_layers": list(head.config.feature_layers),
        "draft_vocab_size": head.config.draft_vocab_size,
        "steps": n,
        "tokens": n * batch * seq_len,
        "train_seconds": round(seconds, 1),
        "seconds": round(time.monotonic() - start, 1),
        "losses": {
            "first": round(float(np.mean(losses[:10])), 4),
            "final": round(float(np.mean(losses[-50:])), 4),
            "every_10": [round(float(np.mean(losses[i : i + 10])), 4) for i in range(0, n, 10)],
        },
        "validation": metrics,
    }
    (out / "train.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"train-eagle: wrote {out} in {info['seconds']:.0f}s: loss {info['losses']['first']:.3f} -> "
        f"{info['losses']['final']:.3f}, top-1 agreement {metrics['top1_agreement']:.3f}, "
        f"mean accepted {metrics['mean_accepted']:.2f} of {CHAIN_DEPTH}")
    return head, info


def head_training(steps: int, budget_s: float | None, lr: float, batch: int, seq_len: int) -> TrainConfig:
    """A drafter trainer's schedule: ``steps`` or ``budget_s``, warming up over a tenth of the steps (at most 50)."""
    return TrainConfig(budget_s=budget_s or math.inf, max_steps=steps, lr=lr, batch=batch, seq=seq_len,
                       warmup=min(50, max(1, steps // 10)))


def train_and_validate(head: nn.Module, model: nn.Module, capture: FeatureCapture, loss_fn: Loss, data: np.ndarray,
                       val: np.ndarray, cfg: TrainConfig, seed: int, log: Log, check: Callable[..., dict],
                       command: str = "train-eagle") -> tuple[list[float], int, float, dict]:
    """Train ``head`` (``_train``), then ``check`` it on ``val``; the target is unhooked either way.
    Returns the losses, steps, seconds and what ``check`` measured."""
    try:
        losses, n, seconds = _train(head, model, capture, loss_fn, data, cfg, seed, log, command)
        return losses, n, seconds, check(head, model, capture, loss_fn, val, batch=16)
    finally:
        capture.remove()


def _train(head: nn.Module, model: nn.Module, capture: FeatureCapture, loss_fn: Loss,
           data: np.ndarray, cfg: TrainConfig, seed: int, log: Log,
           command: str = "train-eagle") -> tuple[list[float], int, float]:
    """AdamW on random windows of ``data`` (a head that reads ``capture``'s features: an EAGLE or
    an MTP head); returns the losses, steps and seconds."""
    if len(data) <= cfg.seq:
        raise ValueError(f"{len(data)} training tokens are too few for --seq-len {cfg.seq}")
    embed, _ = target_parts(model)
    opt = optim.AdamW(learning_rate=cfg.lr, betas=[0.9, 0.95], weight_decay=cfg.weight_decay)
    opt.init(head.trainable_parameters())
    loss_and_grad = nn.value_and_grad(head, loss_fn)
    state = [head.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(tokens: mx.array) -> mx.array:
        loss, grads = loss_and_grad(head, *target_pass(model, capture, embed, tokens))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        return loss

    rng = np.random.default_rng(seed)
    start = last_log = time.monotonic()
    losses: list[float] = []
    while len(losses) < cfg.max_steps:
        n = len(losses)
        progress = max(n / cfg.max_steps, (time.monotonic() - start) / cfg.budget_s)
        if progress >= 1.0:
            break
        opt.learning_rate = lr_at(cfg, progress, n)
        starts = rng.integers(0, len(data) - cfg.seq + 1, size=cfg.batch)
        loss = step(mx.array(np.stack([data[s : s + cfg.seq] for s in starts])))
        mx.eval(loss, state)
        losses.append(loss.item())
        if (now := time.monotonic()) - last_log >= 30:
            last_log = now
            log(f"{command}: step {n + 1} loss {np.mean(losses[-20:]):.3f} "
                f"{(n + 1) * cfg.batch * cfg.seq / (now - start):.0f} tok/s {now - start:.0f}s")
    return losses, len(losses), time.monotonic() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``specd train-eagle``'s arguments to a (sub)parser."""
    parser.add_argument("--target", type=Path, required=True, help="local mlx-lm target model directory")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the head into")
    parser.add_argument("--version", type=int, choices=(1, 3), default=1, help="EAGLE-1 or EAGLE-3")
    parser.add_argument("--corpus", type=Path, nargs="+", default=None, metavar="PATH",
                        help="text files or directories (default: the Python stdlib sources, as the forge)")
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                        help=f"training steps (default {DEFAULTS['steps']})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop earlier when this many seconds of training are spent")
    parser.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                        help=f"tokens per training window (default {DEFAULTS['seq_len']})")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"],
                        help=f"windows per step (default {DEFAULTS['batch']})")
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"],
                        help=f"peak AdamW learning rate (default {DEFAULTS['lr']})")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="EAGLE-3: draft over the N most frequent corpus tokens (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    """Run ``specd train-eagle`` for parsed ``args``; returns a process exit code."""
    if args.draft_vocab is not None and args.version != 3:
        print("specd train-eagle: --draft-vocab needs --version 3", file=sys.stderr)
        return 2
    _, info = train_eagle(args.target, args.out, version=args.version, corpus=args.corpus,
                       steps=args.steps, budget_s=args.budget_s, seq_len=args.seq_len,
                       batch=args.batch, lr=args.lr, draft_vocab=args.draft_vocab, seed=args.seed,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps({"out": str(args.out), "steps": info["steps"], "seconds": info["seconds"],
                      **info["validation"]}))
    return 0
