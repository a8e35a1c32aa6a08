"""Every model family mlx-lm serves, batched and speculating.

One tiny random-weight model per family, built from the family's real
config shape (``specd.forge.families``) and loaded through ``mlx_lm.load``.
Sliding windows are a few tokens wide, so prompt plus completion wraps them
while speculation rolls back; recurrent families roll their state back.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from conftest import code_sample, run_engine
from specd.core.loader import load_model
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.forge.families import FAMILIES, build

GREEDY = SamplingParams(temperature=0)
NGRAM = SpeculationConfig("ngram", 4, 1, 3)
DRAFT = SpeculationConfig("draft", 3)
MAX_TOKENS = 40
QUANTIZED = {"llama": {"group_size": 64, "bits": 4, "mode": "affine"},
             "gemma3_text": {"group_size": 64, "bits": 4, "mode": "affine"},
             "qwen3_next": {"group_size": 64, "bits": 4, "mode": "affine"},
             "gpt_oss": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}
_ids = itertools.count()


@pytest.fixture(scope="session")
def family_models(forged, tmp_path_factory):
    """Builds a family's model on first use: ``get(family, seed, quantization)`` -> its directory."""
    root = tmp_path_factory.mktemp("families")
    built: dict[tuple, Path] = {}

    def get(family: str, seed: int = 0, quantization: dict | None = None) -> Path:
        key = (family, seed, None if quantization is None else tuple(sorted(quantization.items())))
        if key not in built:
            name = f"{family}-{seed}" + ("" if quantization is None else f"-{quantization['mode']}{quantization['bits']}")
            built[key] = build(family, root / name, forged / "target", seed=seed, quantization=quantization)
        return built[key]
    return get


def prompts(tokenizer) -> list[list[int]]:
    """Three code prompts of different lengths, one repetitive so n-gram lookup finds matches."""
    ids = tokenizer.encode(code_sample("speculation"))
    return [ids[:11], ids[300:322], ids[40:52] * 3]


def reference(model, tokenizer, prompt: list[int]) -> list[int]:
    """mlx-lm's own greedy decoding of ``prompt`` alone, up to its first end of text."""
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


async def generate(engine, prompt, spec=None, delay=0.0) -> list[int]:
    await asyncio.sleep(delay)
    request = GenerationRequest(f"f{next(_ids)}", prompt, GREEDY, MAX_TOKENS, (), spec)
    tokens = []
    async for out in engine.generate(request):
        assert out.error is None, out.error
        tokens += out.tokens
    return tokens


def staggered(model, tokenizer, batch: list[list[int]], spec=None, draft=None) -> list[list[int]]:
    """The prompts in one engine, arriving a little apart so rows join a batch
    mid-flight; a speculating run must have had proposals rejected (rolled back)."""
    async def go(engine):
        out = await asyncio.gather(*(generate(engine, p, spec, 0.01 * i) for i, p in enumerate(batch)))
        speculator = engine.scheduler.speculator
        return out, speculator.drafted_total, speculator.accepted_total
    out, drafted, accepted = run_engine(model, tokenizer, go, draft, max_batch_size=4, prefill_step_tokens=16)
    if spec is not None and draft is not model:
        assert drafted > accepted, f"{drafted} tokens drafted, {accepted} accepted: nothing was rolled back"
    return out


def check_family(path: Path, draft_path: Path | None = None) -> None:
    model, tokenizer = load_model(str(path))
    batch = prompts(tokenizer)
    expected = [reference(model, tokenizer, p) for p in batch]
    assert staggered(model, tokenizer, batch) == expected, "batched spec-off differs from mlx-lm alone"
    assert staggered(model, tokenizer, batch, NGRAM) == expected, "n-gram speculation changed the output"
    if draft_path is not None:
        draft, _ = load_model(str(draft_path))
        for drafter in (draft, model):  # mostly rejected, then always accepted
            assert staggered(model, tokenizer, batch, DRAFT, drafter) == expected, "draft speculation changed it"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_mlx_lm_batched_and_speculating(family, family_models):
    check_family(family_models(family))


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_draft_models_of_rotating_and_recurrent_families(family, family_models):
    check_family(family_models(family), family_models(family, seed=1))


@pytest.mark.parametrize("family", sorted(QUANTIZED))
def test_quantized_family(family, family_models):
    check_family(family_models(family, quantization=QUANTIZED[family]))
