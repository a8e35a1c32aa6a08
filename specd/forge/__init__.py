"""The model forge: builds the target/draft Llama pair the project serves.

No model hub is reachable, so ``forge`` makes its own models: a byte-level
BPE tokenizer trained on the Python standard library's sources, and two
mlx_lm-loadable float32 Llama models sharing it, written to
``OUT_DIR/target`` and ``OUT_DIR/draft`` with a summary in
``OUT_DIR/forge.json`` (the demo preset adds a DFlash drafter for the target
in ``OUT_DIR/dflash``); ``OUT_DIR/agent`` is the target with a chat
template that renders tools (Hermes conventions) and a window wide enough
for an agent client's prompt, so Claude Code, Codex and OpenCode can be
tried against it offline; ``OUT_DIR/vision`` is the target as the language model
of a LLaVA checkpoint with a random vision tower, in the agent's conventions, so
images can be sent to it.

Presets: ``test`` (random, tiny, deterministic, seconds), ``quick`` (the
demo's shapes trained for under a minute) and ``demo`` (trained for about nine
minutes, then an MTP head and a DFlash drafter for about ten more); each is cached by
recipe hash.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from . import llama
from .chat import chat_variant
from .dflash import train_dflash
from .mtp import train_mtp
from .presets import BUDGET_ENV, PRESETS, Recipe, get_recipe
from .tokenizer import EOS, IM_END, save_tokenizer, spread, stdlib_sources, train_tokenizer
from .train import encode_corpus, evaluate, train, windows
from .vision import agent_variant as vision_agent
from .vision import build as build_vision

__all__ = ["forge", "add_arguments", "run", "PRESETS", "BUDGET_ENV", "AGENT_CONTEXT"]

MANIFEST = "forge.json"
MODELS = ("target", "draft")
DFLASH = "dflash"
AGENT = "agent"
AGENT_CONTEXT = 65536  # tokens: an agent client's system prompt and tools fit several times over
VISION = "vision"

Log = Callable[[str], None]


def forge(
    out_dir: Path | str,
    preset: str = "test",
    seed: int = 0,
    log: Log = print,
    force: bool = False,
) -> dict:
    """Build (or reuse) a target/draft pair in ``out_dir`` and describe it.

    Returns the contents of ``forge.json`` plus ``out_dir``, ``target_path``
    and ``draft_path``. A completed forge of the same recipe hash is reused
    unless ``force``; the test preset is byte-for-byte deterministic per seed.
    """
    out_dir = Path(out_dir)
    recipe = get_recipe(preset)
    digest = recipe.digest(seed)
    if not force and (cached := _load_cached(out_dir, digest)) is not None:
        log(f"forge: {out_dir} already holds {preset} seed {seed} ({digest[:12]}), reusing")
        if not (out_dir / AGENT / "config.json").is_file():
            _write_agent(out_dir)
        if not (out_dir / VISION / "config.json").is_file():
            _write_vision(out_dir, log)
        return _with_paths(cached, out_dir)

    start = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / f".forge-tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        info = _build(recipe, seed, staging, log)
        info["recipe_hash"] = digest
        if recipe.trained:  # wall time would break the test preset's determinism
            info["seconds"] = round(time.monotonic() - start, 1)
        (out_dir / MANIFEST).unlink(missing_ok=True)
        for name in (*MODELS, DFLASH):
            shutil.rmtree(out_dir / name, ignore_errors=True)
            if (staging / name).exists():
                (staging / name).rename(out_dir / name)
        _write_agent(out_dir)
        _write_vision(out_dir, log)
        # Written last: its presence marks a complete forge.
        (out_dir / MANIFEST).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"forge: wrote {out_dir} in {time.monotonic() - start:.1f}s: val loss "
        f"target {info['target']['val_loss']:.3f} draft {info['draft']['val_loss']:.3f}, "
        f"top-1 agreement {info['agreement_top1']:.3f}"
    )
    return _with_paths(info, out_dir)


def _build(recipe: Recipe, seed: int, staging: Path, log: Log) -> dict:
    """Train the tokenizer, make both models and save them under ``staging``."""
    sources = stdlib_sources()
    tok_sources = spread(sources, recipe.tokenizer_corpus_bytes)
    tok = train_tokenizer([text for _, text in tok_sources], recipe.vocab_size)
    save_tokenizer(tok, staging / "tokenizer")
    eos_ids = [tok.token_to_id(EOS), tok.token_to_id(IM_END)]
    log(f"forge: tokenizer of {tok.get_vocab_size()} tokens on {len(tok_sources)} stdlib files")

    # Hold out every n-th file; random presets only need a little validation text.
    corpus = sources if recipe.trained else tok_sources
    val_texts = [t for i, (_, t) in enumerate(corpus) if i % recipe.val_every == 0]
    val = windows(encode_corpus(tok, val_texts, eos_ids[0]), 64, recipe.val_windows)

    target = llama.build(recipe.target)
    draft = llama.build(recipe.draft)
    stats: dict[str, dict] = {"target": {}, "draft": {}}
    if recipe.trained:
        train_texts = [t for i, (_, t) in enumerate(corpus) if i % recipe.val_every != 0]
        data = encode_corpus(tok, train_texts, eos_ids[0])
        log(f"forge: {len(data)} training tokens, {val.size} validation tokens")
        llama.init_weights(target, seed)
        llama.init_weights(draft, seed + 1)
        for name, model, cfg, teacher in (
            ("target", target, recipe.target_train, None),
            ("draft", draft, recipe.draft_train, target),
        ):
            log(f"forge: training {name} ({llama.num_params(model):,} parameters)")
            res = train(model, data, cfg, seed, log, name, teacher=teacher)
            stats[name]["train"] = {
                "steps": res.steps,
                "tokens": res.tokens,
                "seconds": round(res.seconds, 1),
                "final_train_loss": round(res.final_train_loss, 4),
            }
    else:
        embed_std, std, head_std = recipe.init_std
        llama.init_weights(target, seed, embed_std, std, head_std)
        _copy_shared(target, draft)

    info: dict = {"preset": recipe.preset, "seed": seed, "recipe": recipe.as_dict(seed)}
    preds = {}
    for name, model, shape in (("target", target, recipe.target), ("draft", draft, recipe.draft)):
        config = llama.hf_config(shape, eos_ids, pad_token_id=eos_ids[0])
        llama.save(model, config, staging / "tokenizer", staging / name)
        val_loss, preds[name] = evaluate(model, val)
        info[name] = {"params": llama.num_params(model), "val_loss": round(val_loss, 4), **stats[name]}
    info["agreement_top1"] = round(float((preds["draft"] == preds["target"]).mean()), 4)
    if recipe.mtp_train is not None:
        cfg = recipe.mtp_train
        log("forge: training the target's MTP head")
        trained = train_mtp(staging / "target", steps=cfg.max_steps, budget_s=cfg.budget_s, seq_len=cfg.seq,
                            batch=cfg.batch, lr=cfg.lr, seed=seed, log=log)
        info["mtp"] = {"steps": trained["steps"], "seconds": trained["train_seconds"], **trained["validation"]}
    if recipe.dflash_train is not None:
        cfg = recipe.dflash_train
        log("forge: training a DFlash drafter for the target")
        trained = train_dflash(staging / "target", staging / DFLASH, steps=cfg.max_steps, budget_s=cfg.budget_s,
                               seq_len=cfg.seq, batch=cfg.batch, lr=cfg.lr, seed=seed, log=log)
        info["dflash"] = {"steps": trained["steps"], "seconds": trained["train_seconds"], **trained["validation"]}
    info["eos_token_ids"] = eos_ids
    info["validation_tokens"] = int(val.shape[0] * (val.shape[1] - 1))  # scored positions
    return info


def _write_agent(out_dir: Path) -> None:
    shutil.rmtree(out_dir / AGENT, ignore_errors=True)
    chat_variant(out_dir / "target", out_dir / AGENT, "hermes", context=AGENT_CONTEXT)


def _write_vision(out_dir: Path, log: Log) -> None:
    """``OUT/vision``: a LLaVA checkpoint whose language model is the target, its vision tower
    random (images change its answers; it was never taught to see), in the agent model's
    conventions (Hermes tools, a wide window) with image parts: the quick start's, and one an
    agent client can send screenshots to."""
    if importlib.util.find_spec("mlx_vlm") is None:
        log(f"forge: no {VISION} model: it needs mlx-vlm (pip install 'specd[vision]')")
        return
    staging = out_dir / f".{VISION}-{os.getpid()}"
    try:
        build_vision("llava", staging, out_dir / "target", language_model=out_dir / "target")
        shutil.rmtree(out_dir / VISION, ignore_errors=True)
        vision_agent(staging, out_dir / VISION, AGENT_CONTEXT)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _copy_shared(target: llama.Model, draft: llama.Model) -> None:
    """Give ``draft`` the target's weights of the same names (a layer-skip draft)."""
    src = dict(tree_flatten(target.parameters()))
    draft.update(tree_unflatten([(k, src[k]) for k, _ in tree_flatten(draft.parameters())]))
    mx.eval(draft.parameters())


def _load_cached(out_dir: Path, digest: str) -> dict | None:
    try:
        info = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if info.get("recipe_hash") != digest:
        return None
    if not all((out_dir / m / "model.safetensors").is_file() for m in MODELS):
        return None
    return info


def _with_paths(info: dict, out_dir: Path) -> dict:
    out_dir = out_dir.resolve()
    return {
        **info,
        "out_dir": str(out_dir),
        "target_path": str(out_dir / "target"),
        "draft_path": str(out_dir / "draft"),
        "agent_path": str(out_dir / AGENT),
        "vision_path": str(out_dir / VISION),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the forge's arguments to a (sub)parser: out_dir, --preset, --seed, --force."""
    parser.add_argument("out_dir", type=Path, help="directory to write target/ and draft/ into")
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default="test",
        help="test: random tiny pair in seconds; quick: the demo's shapes trained for under a minute; "
        "demo: trained pair (~10 min); all cached",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if OUT_DIR holds this recipe"
    )
    parser.add_argument(
        "--check", action="store_true", help="build nothing: exit 0 if OUT_DIR holds this recipe, else 1"
    )
    parser.add_argument(
        "--inflate", type=int, metavar="WIDTH", default=None,
        help="also write OUT_DIR/target-inflated: the target with MLPs widened to WIDTH by "
        "function-preserving zero-output units (a memory-bound target for speculation benchmarks)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the forge for parsed CLI ``args``; returns a process exit code."""
    if args.check:
        digest = get_recipe(args.preset).digest(args.seed)
        return 0 if _load_cached(Path(args.out_dir), digest) is not None else 1
    info = forge(args.out_dir, preset=args.preset, seed=args.seed, force=args.force)
    summary = {k: info[k] for k in ("target_path", "draft_path", "agreement_top1")}
    if args.inflate:
        from .inflate import inflate

        out = Path(args.out_dir) / "target-inflated"
        summary["inflated"] = {"path": str(out), **inflate(Path(info["target_path"]), out, args.inflate)}
    print(json.dumps(summary))
    return 0
