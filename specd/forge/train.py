"""Time-boxed training of the demo pair: a target LM, then a distilled draft.

Training stops at a fixed step count or when the wall-clock budget is spent,
whichever comes first; the learning-rate schedule runs on the larger of the
two progress fractions, so a slow machine still finishes its cosine decay.
On a fast enough machine the step count binds and runs are reproducible.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tokenizers import Tokenizer

Log = Callable[[str], None]


@dataclass(frozen=True)
class TrainConfig:
    """One training phase's recipe."""

    budget_s: float
    max_steps: int
    lr: float
    batch: int = 8
    seq: int = 64
    warmup: int = 50
    min_lr_frac: float = 0.1
    weight_decay: float = 0.05
    # Draft only: weight of the teacher's top-1 label against the data label.
    teacher_mix: float = 0.0


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    final_train_loss: float


def encode_corpus(tok: Tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """Token ids of ``texts`` concatenated, each document followed by EOS."""
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos_id)
    return np.asarray(out, dtype=np.int32)


def windows(data: np.ndarray, seq: int, count: int) -> np.ndarray:
    """``count`` evenly spaced windows of ``seq + 1`` tokens (input plus shifted label)."""
    count = min(count, (len(data) - 1) // (seq + 1))
    starts = np.linspace(0, len(data) - seq - 1, count).astype(np.int64)
    return np.stack([data[s : s + seq + 1] for s in starts])


def lr_at(cfg: TrainConfig, progress: float, step: int) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * warm * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * cos)


def _label_logit(logits: mx.array, labels: mx.array) -> mx.array:
    return mx.take_along_axis(logits, labels[..., None], axis=-1).squeeze(-1)


def _token_ce(logits: mx.array, labels: mx.array) -> mx.array:
    return mx.logsumexp(logits, axis=-1) - _label_logit(logits, labels)


def train(
    model: nn.Module,
    data: np.ndarray,
    cfg: TrainConfig,
    seed: int,
    log: Log,
    name: str,
    teacher: nn.Module | None = None,
) -> TrainResult:
    """Train ``model`` on random windows of ``data`` with AdamW, warmup + cosine.

    With a ``teacher`` the loss mixes cross-entropy on the teacher's greedy
    token (weight ``cfg.teacher_mix``) with cross-entropy on the real next
    token: fitting the teacher's top-1 raises draft agreement, and the real
    labels keep the draft from becoming overconfident.
    """
    mix = cfg.teacher_mix if teacher is not None else 0.0

    def loss_fn(m: nn.Module, x: mx.array, y: mx.array, t: mx.array) -> mx.array:
        logits = m(x)
        if mix == 0.0:
            return _token_ce(logits, y).mean()
        # One logsumexp for both labels: element-wise ops dominate on CPU.
        lse = mx.logsumexp(logits, axis=-1)
        ce_y = lse - _label_logit(logits, y)
        ce_t = lse - _label_logit(logits, t)
        return ((1 - mix) * ce_y + mix * ce_t).mean()

    opt = optim.AdamW(learning_rate=cfg.lr, betas=[0.9, 0.95], weight_decay=cfg.weight_decay)
    opt.init(model.trainable_parameters())
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x: mx.array, y: mx.array, t: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, x, y, t)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    if teacher is not None:
        teacher_top1 = mx.compile(lambda x: mx.argmax(teacher(x), axis=-1))

    rng = np.random.default_rng(seed)
    hi = len(data) - cfg.seq - 1
    start = last_log = time.monotonic()
    losses: list[float] = []
    n = 0
    while n < cfg.max_steps:
        elapsed = time.monotonic() - start
        progress = max(n / cfg.max_steps, elapsed / cfg.budget_s)
        if progress >= 1.0:
            break
        opt.learning_rate = lr_at(cfg, progress, n)
        starts = rng.integers(0, hi, size=cfg.batch)
        batch = mx.array(np.stack([data[s : s + cfg.seq + 1] for s in starts]))
        x, y = batch[:, :-1], batch[:, 1:]
        t = teacher_top1(x) if teacher is not None else y
        loss = step(x, y, t)
        mx.eval(loss, state)
        losses.append(loss.item())
        n += 1
        now = time.monotonic()
        if now - last_log >= 30:
            last_log = now
            recent = float(np.mean(losses[-50:]))
            log(
                f"forge: {name} step {n} loss {recent:.3f} "
                f"{n * cfg.batch * cfg.seq / (now - start):.0f} tok/s {now - start:.0f}s"
            )
    seconds = time.monotonic() - start
    final = float(np.mean(losses[-50:])) if losses else float("nan")
    log(f"forge: {name} done: {n} steps in {seconds:.0f}s, train loss {final:.3f}")
    return TrainResult(n, n * cfg.batch * cfg.seq, seconds, final)


def evaluate(model: nn.Module, val: np.ndarray, batch: int = 16) -> tuple[float, np.ndarray]:
    """Mean next-token cross-entropy over validation windows, and the argmax
    predictions (kept so that draft/target agreement needs no second pass)."""
    total, count = 0.0, 0
    preds = []
    for i in range(0, len(val), batch):
        w = mx.array(val[i : i + batch])
        logits = model(w[:, :-1])
        ce = _token_ce(logits, w[:, 1:])
        total += ce.sum().item()
        count += ce.size
        preds.append(np.array(mx.argmax(logits, axis=-1)))
    return total / count, np.concatenate(preds)


def add_training_arguments(parser: argparse.ArgumentParser, defaults: dict, integers: tuple[str, ...]) -> None:
    """What every drafter trainer takes besides its target: the corpus, the integer settings named
    (``seq_len`` -> ``--seq-len``), the learning rate, a time budget and a seed."""
    parser.add_argument("--corpus", type=Path, nargs="+", default=None, metavar="PATH",
                        help="text files or directories (default: the Python stdlib sources, as the forge)")
    for name in integers:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name],
                            help=f"(default {defaults[name]})")
    parser.add_argument("--lr", type=float, default=defaults["lr"],
                        help=f"peak learning rate (default {defaults['lr']})")
    parser.add_argument("--budget-s", type=float, default=None, help="stop when this many seconds are spent")
    parser.add_argument("--seed", type=int, default=0)
