#!/usr/bin/env python3
"""How far quantized KV (kvCache.bits) moves a model's output from full precision.

For each model and bits, the engine decodes the same prompts greedily with
float KV and with quantized KV, and reports, side by side:

* ``same``: the fraction of requests whose tokens are identical;
* ``first_diff``: the median index of the first differing token (the length
  when none differs);
* ``dlogprob``: the median and largest |difference| of the chosen token's
  log-probability, over the tokens before the first difference;
* ``bytes``: KV bytes per token against float KV.

Speculation is not involved: it is lossless with respect to whichever KV the
model runs (``tests/core/test_kv_quantization.py``). The models are random-weight
ones of each family's shape with 64-dimension heads (MLX quantizes groups of
32, 64 or 128 dimensions), so these figures bound the drift of a model that
has learned nothing; a trained checkpoint's logits are sharper.

    python ops/bench/kv_quantization.py [--families llama gemma3_text qwen3_next]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
from pathlib import Path


from spec_decode import machine_info, write_result
from specd.core.loader import load_model as load  # as the daemon loads (core.cpu_jit first)
from specd.core.cache import kv_bytes
from specd.core.columns import KVQuantization
from specd.core.memory import reuse_freed_memory
from specd.core.request import GenerationRequest
from specd.core.sampling import SamplingParams
from specd.engine.engine import Engine
from specd.engine.scheduler import EngineConfig
from specd.forge.families import family_config, make_model

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "kv_quantization.json"
_ids = itertools.count()


def wide_heads(family: str) -> dict:
    config = family_config(family)
    config.get("text_config", config)["head_dim"] = 64
    return config


async def decode(model, tokenizer, prompts: list[list[int]], max_tokens: int, bits: int | None):
    """Each prompt's greedy tokens and their log-probabilities."""
    engine = Engine("bench", model, tokenizer, EngineConfig(max_batch_size=8, prefix_cache_bytes=0, kv_bits=bits))
    engine.start()
    params = SamplingParams(temperature=0, logprobs=True)

    async def one(prompt):
        tokens, logprobs = [], []
        async for out in engine.generate(GenerationRequest(f"b{next(_ids)}", prompt, params, max_tokens)):
            tokens += out.tokens
            logprobs += [lp.logprob for lp in out.logprobs or []]
        return tokens, logprobs
    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await engine.shutdown(1)


def compare(full, quantized) -> dict:
    firsts, deltas = [], []
    for (a, la), (b, lb) in zip(full, quantized):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        firsts.append(first)
        deltas += [abs(x - y) for x, y in zip(la[:first], lb[:first])]
    return {"same": sum(a == b for (a, _), (b, _) in zip(full, quantized)) / len(full),
            "first_diff_median": statistics.median(firsts),
            "dlogprob_median": statistics.median(deltas) if deltas else None,
            "dlogprob_max": max(deltas) if deltas else None}


def main(argv: list[str] | None = None) -> int:
    reuse_freed_memory()  # the C heap as the daemon sets it (specd/cli.py)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=["llama", "gemma3_text", "qwen3_next"])
    p.add_argument("--tokenizer", type=Path, default=REPO_ROOT / "models" / "demo" / "target",
                   help="a forged model directory whose tokenizer the prompts use")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    _, tokenizer = load(str(args.tokenizer))
    text = (REPO_ROOT / "tests" / "data" / "speculation_sample.txt").read_text()
    ids = tokenizer.encode(text)
    prompts = [ids[i * 97: i * 97 + 24 + 13 * i] for i in range(args.prompts)]
    rows = []
    print(f"{'family':<14}{'bits':>5}{'bytes':>8}{'same':>7}{'first diff':>12}{'|dlogp| med':>13}{'max':>9}")
    for family in args.families:
        model = make_model(wide_heads(family))
        full = asyncio.run(decode(model, tokenizer, prompts, args.max_tokens, None))
        for bits in (8, 4):
            quantized = asyncio.run(decode(model, tokenizer, prompts, args.max_tokens, bits))
            row = {"family": family, "bits": bits,
                   "bytes_ratio": kv_bytes(model, KVQuantization(bits))[0] / kv_bytes(model)[0],
                   **compare(full, quantized)}
            rows.append(row)
            med, top = row["dlogprob_median"], row["dlogprob_max"]
            print(f"{family:<14}{bits:>5}{row['bytes_ratio']:>8.3f}{row['same']:>7.2f}{row['first_diff_median']:>12}"
                  f"{'-' if med is None else f'{med:.4f}':>13}{'-' if top is None else f'{top:.4f}':>9}")
    write_result(str(args.out), {"machine": machine_info(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
