"""KV quantization (kvCache.bits): a quarter or an eighth of float32's bytes,
and speculation lossless with respect to the quantized model: greedy tokens
identical with and without speculation at the same bits, for full, windowed
and hybrid attention, in mixed and staggered batches."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from mlx_lm import load

from conftest import code_sample, head_for, run_engine
from specd.api.manifest import ManifestError, parse_documents
from specd.core.cache import kv_bytes
from specd.core.columns import KVQuantization
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.forge.dflash import fresh_drafter
from specd.forge.mtp import fresh_head
from specd.core.sampling import SamplingParams
from specd.forge.families import family_config, make_model

GREEDY = SamplingParams(temperature=0)
NGRAM = SpeculationConfig("ngram", 3)
DRAFT = SpeculationConfig("draft", 3)
EAGLE = SpeculationConfig("eagle", 3, tree_top_k=3, tree_tokens=8)
_ids = itertools.count()


def wide_heads(family: str) -> dict:
    """The family's tiny config with heads of 64 dimensions (MLX quantizes groups of 32, 64 or 128)."""
    config = family_config(family)
    text = config.get("text_config", config)
    text["head_dim"] = 64
    return config


@pytest.fixture(scope="module")
def tokenizer_and_draft(forged):
    draft, tokenizer = load(str(forged / "draft"))
    return tokenizer, draft


@pytest.fixture(scope="module")
def prompts(tokenizer_and_draft) -> list[list[int]]:
    ids = tokenizer_and_draft[0].encode(code_sample("speculation"))
    return [ids[i * 71: i * 71 + 15 + 11 * i] for i in range(4)] + [ids[30:50] * 3]


async def generate(engine, prompt, spec=None, delay=0.0) -> list[int]:
    await asyncio.sleep(delay)
    request = GenerationRequest(f"q{next(_ids)}", prompt, GREEDY, 40, (), spec)
    return [t async for out in engine.generate(request) for t in out.tokens]


def serve(model, tokenizer, prompts, specs, drafter=None, **config) -> list[list[int]]:
    async def go(engine):
        return await asyncio.gather(*(generate(engine, p, s, 0.01 * (i % 3))
                                      for i, (p, s) in enumerate(zip(prompts, specs))))
    return run_engine(model, tokenizer, go, drafter, max_batch_size=8, **config)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_speculation_is_lossless_at_the_same_bits(tokenizer_and_draft, prompts, family, bits):
    tokenizer, draft = tokenizer_and_draft
    model = make_model(wide_heads(family))
    plain = serve(model, tokenizer, prompts, [None] * 5, kv_bits=bits)
    assert serve(model, tokenizer, prompts, [NGRAM, None, NGRAM, NGRAM, None], kv_bits=bits) == plain
    assert serve(model, tokenizer, prompts, [DRAFT, NGRAM, None, DRAFT, DRAFT], draft, kv_bits=bits) == plain
    mtp = SpeculationConfig("mtp", 3)  # a head of the model's own attention layer kind
    assert serve(model, tokenizer, prompts, [mtp, NGRAM, None, mtp, mtp], fresh_head(model), kv_bits=bits) == plain
    dflash = SpeculationConfig("dflash", 5, tree_top_k=2, tree_tokens=8)  # trees, except on the hybrid target
    assert serve(model, tokenizer, prompts, [dflash, None, NGRAM, dflash, dflash], fresh_drafter(model),
                 kv_bits=bits) == plain
    if family == "llama":
        head = head_for(model, 1)  # EAGLE-1: the tiny llama has too few layers to fuse three
        assert serve(model, tokenizer, prompts, [EAGLE, None, EAGLE, NGRAM, EAGLE], head, kv_bits=bits) == plain


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_quantized_rows_read_their_cached_prefix_in_place_with_the_same_tokens(tokenizer_and_draft, family):
    """Requests that extend earlier ones start from the prefix cache's quantized
    columns, read in place (full and windowed layers); their greedy tokens,
    with and without speculation, equal a run without the prefix cache."""
    tokenizer, _ = tokenizer_and_draft
    model = make_model(wide_heads(family))
    ids = tokenizer.encode(code_sample("speculation"))
    prompts = [ids[40 * i: 40 * i + 300] for i in range(4)]  # long enough to be read in place
    followups = [p + p[:7] for p in prompts]

    def serve_twice(**config):
        async def go(engine):
            first = await asyncio.gather(*(generate(engine, p) for p in prompts))
            then = await asyncio.gather(*(generate(engine, f, NGRAM if i % 2 else None, 0.01 * (i % 3))
                                          for i, f in enumerate(followups)))
            return first, then, engine.scheduler.prefix_store.hits
        return run_engine(model, tokenizer, go, max_batch_size=8, kv_bits=8, **config)
    cached, uncached = serve_twice(), serve_twice(prefix_cache_bytes=0)
    assert cached[:2] == uncached[:2]
    assert cached[2] >= sum(map(len, prompts)) // 2, cached[2]


def test_quantized_kv_takes_a_fraction_of_the_bytes(tokenizer_and_draft):
    model = make_model(wide_heads("llama"))
    full = kv_bytes(model)[0]  # float32: 4 bytes a dimension
    # a byte (or half of one) a dimension, and a float32 scale and bias per group of 32
    assert kv_bytes(model, KVQuantization(8, 32))[0] == full * (64 + 2 * 2 * 4) // (64 * 4)
    assert kv_bytes(model, KVQuantization(4, 32))[0] == full * (32 + 2 * 2 * 4) // (64 * 4)


def test_a_head_the_group_size_does_not_divide_fails_the_load_with_the_reason(forged):
    model, tokenizer = load(str(forged / "target"))  # heads of 16 dimensions
    with pytest.raises(ValueError, match="kvCache.groupSize 32"):
        run_engine(model, tokenizer, lambda engine: asyncio.sleep(0), kv_bits=8, kv_group_size=32)


def test_kv_bits_and_group_size_in_a_manifest():
    def spec(kv: str):
        return parse_documents("apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: m}\n"
                               f"spec: {{source: x, kvCache: {kv}}}\n")[0].spec
    assert (spec("{bits: 4}").kv_cache_bits, spec("{bits: 4}").kv_cache_group_size) == (4, 64)
    assert spec("{bits: 8, groupSize: 32}").kv_cache_group_size == 32
    assert spec("{maxBytes: 1Gi}").kv_cache_bits is None
    for kv, path in [("{bits: 3}", "spec.kvCache.bits"), ("{bits: true}", "spec.kvCache.bits"),
                     ("{bits: 8, groupSize: 48}", "spec.kvCache.groupSize")]:
        with pytest.raises(ManifestError) as refused:
            spec(kv)
        assert refused.value.path == path
