#!/usr/bin/env python3
"""A sliding-window and a recurrent model: specd against ``mlx_lm.server``,
and speculation on them, in one run.

Both models come from the demo pair (``specd forge models/demo --preset
demo``), so they write the code its draft and n-gram lookup can predict:

* ``sliding``: the demo target with five of its six layers made
  sliding-window (``--window`` tokens), the way Gemma 3 mixes them: mlx-lm's
  Llama builds a ``RotatingKVCache`` for ``layer_types: sliding_attention``.
  The trained weights keep predicting within the window.
* ``recurrent``: a Nemotron-H-shaped hybrid (Mamba-2 layers, MLPs, one
  attention layer) distilled from the demo target for ``--train-seconds``
  (cached under ``--models`` by recipe).

For each model, each server started on its own (never two at once):
spec-off tokens/s of specd and of ``mlx_lm.server`` at its defaults
(batching and prompt cache on) at concurrency 1 and 8; specd's n-gram and
draft-model (the demo draft) tokens/s at concurrency 1, as a speedup over its
own spec-off.  Medians over runs; the JSON keeps every run.

Usage (from the repository root)::

    python ops/bench/families.py --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Callable

import serve_vs_mlx_lm as anchor
from spec_decode import write_result

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO = REPO_ROOT / "models" / "demo"
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "families.json"

# The demo target's width and depth as a Nemotron-H hybrid: Mamba-2 layers
# (SSM and conv state), MLPs and one attention layer ("M-M*M-").  Mamba-2's
# chunked scan trains about ten times faster on this CPU than a gated delta
# net, whose CPU path steps through the sequence token by token.
RECURRENT = {
    "model_type": "nemotron_h", "hidden_size": 256, "num_hidden_layers": 6, "hybrid_override_pattern": "M-M*M-",
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "attention_bias": False,
    "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 32, "conv_kernel": 4, "n_groups": 1, "expand": 1,
    "chunk_size": 64, "mamba_hidden_act": "silu", "mamba_proj_bias": False, "use_conv_bias": True, "use_bias": False,
    "mlp_bias": False, "mlp_hidden_act": "relu2", "intermediate_size": 704, "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 2048, "residual_in_fp32": False, "time_step_limit": [0.0, float("inf")],
    "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "tie_word_embeddings": False,
    "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64, "n_routed_experts": 1,
    "n_shared_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
}


def sliding_model(demo: Path, out: Path, window: int) -> Path:
    """The demo target, five of six layers sliding-window."""
    if not (out / "config.json").exists():
        shutil.copytree(demo / "target", out, dirs_exist_ok=True)
        config = json.loads((out / "config.json").read_text())
        layers = config["num_hidden_layers"]
        config["layer_types"] = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        config["sliding_window"] = window
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def recurrent_model(demo: Path, models: Path, seconds: float, seed: int = 0) -> Path:
    """A Nemotron-H-shaped hybrid distilled from the demo target (cached by recipe)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer

    from specd.forge.families import make_model
    from specd.forge.llama import TOKENIZER_FILES
    from specd.forge.tokenizer import stdlib_sources
    from specd.forge.train import TrainConfig, encode_corpus, train

    target, _ = load(str(demo / "target"))
    demo_config = json.loads((demo / "target" / "config.json").read_text())
    config = copy.deepcopy(RECURRENT)
    config["vocab_size"] = demo_config["vocab_size"]
    config["eos_token_id"] = demo_config["eos_token_id"]
    recipe = hashlib.sha256(json.dumps([config, seconds, seed], sort_keys=True).encode()).hexdigest()[:12]
    out = models / f"recurrent-{recipe}"
    if (out / "config.json").exists():
        return out
    model = make_model(config, seed)
    tokenizer = Tokenizer.from_file(str(demo / "target" / "tokenizer.json"))
    data = encode_corpus(tokenizer, [text for _, text in stdlib_sources()], demo_config["eos_token_id"][0])
    cfg = TrainConfig(budget_s=seconds, max_steps=100_000, lr=3e-3, teacher_mix=0.7)
    train(model, data, cfg, seed, print, "recurrent", teacher=target)
    mx.eval(model.parameters())
    staging = out.with_name(out.name + ".partial")
    save_model(staging, model)
    save_config(config, staging / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(demo / "target" / name, staging / name)
    staging.replace(out)
    return out


async def measure(name: str, build: Callable[[int], anchor.ServerSpec], concurrencies: list[int],
                  plan: anchor.Plan, env: dict[str, str], workdir: Path) -> dict[str, Any]:
    """One server session: its runs at each concurrency, and medians."""
    port = anchor.free_port()
    print(f"== {name}", flush=True)
    session = await anchor.bench_server(build(port), port, env, workdir,
                                        anchor.Plan(concurrencies, plan.runs, plan.max_tokens,
                                                    plan.max_foreign_cores, plan.retries))
    medians = {c: statistics.median(r.tok_s for r in runs) for c, runs in session["runs"].items()}
    return {"tok_s_median": medians, "session": {**session, "runs": {
        c: [asdict(r) for r in runs] for c, runs in session["runs"].items()}}}


async def bench_model(label: str, model: Path, draft: Path, args: argparse.Namespace, env: dict[str, str],
                      workdir: Path) -> dict[str, Any]:
    plan = anchor.Plan(args.concurrency, args.runs, args.max_tokens, args.max_foreign_cores, args.retries)
    home = {name: workdir / f"{label}-{name}" for name in ("specd", "mlx_lm", "specd_ngram", "specd_draft")}
    for directory in home.values():
        directory.mkdir()
    sessions = {
        "specd": (partial(anchor.specd_spec, model, home["specd"]), args.concurrency),
        "mlx_lm": (partial(anchor.mlx_lm_spec, model, prompt_cache=True, backlog=args.mlx_lm_backlog),
                   args.concurrency),
        "specd_ngram": (partial(anchor.specd_spec, model, home["specd_ngram"], ngram=True,
                                num_draft=args.num_draft_tokens), [1]),
        "specd_draft": (partial(anchor.specd_spec, model, home["specd_draft"], draft=draft,
                                num_draft=args.num_draft_tokens), [1]),
    }
    out = {}
    for name, (build, concurrencies) in sessions.items():
        out[name] = await measure(f"{label}: {name}", build, concurrencies, plan, env, home[name])
    specd, mlx_lm = out["specd"]["tok_s_median"], out["mlx_lm"]["tok_s_median"]
    summary = {f"c{c}": {"specd_tok_s": specd[str(c)], "mlx_lm_tok_s": mlx_lm[str(c)],
                         "ratio": specd[str(c)] / mlx_lm[str(c)]} for c in args.concurrency}
    for method in ("ngram", "draft"):
        tok_s = out[f"specd_{method}"]["tok_s_median"]["1"]
        summary[f"{method}_c1"] = {"tok_s": tok_s, "speedup": tok_s / specd["1"]}
    return {"model": str(model), "summary": summary, "sessions": out}


def print_table(results: dict[str, Any], concurrencies: list[int]) -> None:
    print(f"\n{'model':<10} {'measure':<22} {'specd tok/s':>12} {'mlx_lm tok/s':>13} {'ratio':>7}")
    for label, res in results.items():
        s = res["summary"]
        for c in concurrencies:
            row = s[f"c{c}"]
            print(f"{label:<10} {f'spec off, c={c}':<22} {row['specd_tok_s']:>12.1f} {row['mlx_lm_tok_s']:>13.1f} "
                  f"{row['ratio']:>6.2f}x")
        for method in ("ngram", "draft"):
            row = s[f"{method}_c1"]
            print(f"{label:<10} {f'{method}, c=1 (vs off)':<22} {row['tok_s']:>12.1f} {'':>13} {row['speedup']:>6.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", type=Path, default=DEMO, help="the forged demo pair (target/, draft/)")
    p.add_argument("--models", type=Path, default=REPO_ROOT / "models" / "families",
                   help="where the derived models are written (and reused)")
    p.add_argument("--window", type=int, default=64, help="sliding window of the sliding model")
    p.add_argument("--train-seconds", type=float, default=300, help="distillation budget of the recurrent model")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--max-foreign-cores", type=float, default=0.5)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--mlx-lm-backlog", type=int, default=64,
                   help="listen backlog for mlx_lm.server (see serve_vs_mlx_lm.py; 0: its stock 5)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if 1 not in args.concurrency:
        p.error("--concurrency must include 1 (speedups are measured there)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.demo / "target" / "config.json").exists():
        print(f"{args.demo} holds no demo pair: run `specd forge {args.demo} --preset demo` first", file=sys.stderr)
        return 2
    args.models.mkdir(parents=True, exist_ok=True)
    models = {"sliding": sliding_model(args.demo, args.models / f"sliding-{args.window}", args.window),
              "recurrent": recurrent_model(args.demo, args.models, args.train_seconds)}
    env, preload = anchor.child_env()
    results = {}
    with tempfile.TemporaryDirectory(prefix="specd-bench-families-") as tmp:
        for label, model in models.items():
            results[label] = asyncio.run(bench_model(label, model, args.demo / "draft", args, env, Path(tmp)))
    print_table(results, args.concurrency)
    report = {"benchmark": "families", "created_unix": time.time(),
              "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                         "prompts": list(anchor.PROMPTS), "mlx_lm": "defaults (batching, prompt cache on)"},
              "host": anchor.host_info(), "openblas_preload": preload,
              "versions": {p: anchor.package_version(p) for p in ("mlx", "mlx-lm", "specd")},
              "results": results}
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
