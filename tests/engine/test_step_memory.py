"""What a step holds beyond the weights and the KV cache: a long prompt's prefill
stays within the engine overhead a Model's memory request counts, however long
the context (MLX's peak memory, read around the request)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from conftest import run_engine
from specd.core.request import GenerationRequest
from specd.core.sampling import SamplingParams
from specd.engine.resources import ENGINE_OVERHEAD
from specd.forge.families import build

# Many heads, each narrow: a prefill chunk's attention scores (heads x queries x columns) are
# large beside the model, as in checkpoints users run, at a cost this machine can take
MANY_HEADS = {"hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 16,
              "intermediate_size": 512, "num_hidden_layers": 2, "max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def many_heads(forged, tmp_path_factory):
    return load(str(build("llama", tmp_path_factory.mktemp("many-heads") / "llama", forged / "target",
                          overrides=MANY_HEADS)))


def beyond_weights_and_kv(model, tokenizer, prompt_tokens: int) -> int:
    """MLX's peak memory while an engine (no prefix cache) prefills a fresh prompt of
    ``prompt_tokens`` tokens and samples one token, less what was held before and the most its
    rows' KV held."""
    prompt = [(7 * i) % 1000 + 3 for i in range(prompt_tokens)]

    async def go(engine):
        mx.eval(model.parameters())
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        request = GenerationRequest("long", prompt, SamplingParams(temperature=0), 1)
        tokens = [t async for out in engine.generate(request) for t in out.tokens]
        assert len(tokens) == 1
        return mx.get_peak_memory() - before - engine.kv_cache_status()["peakBytes"]
    return run_engine(model, tokenizer, go, prefix_cache_bytes=0)


def test_a_long_prefill_holds_no_more_than_the_overhead_counted_however_long_the_context(many_heads):
    """A 3,072-token and a 6,144-token prompt, each prefilled alone (chunks of 2,048): what the
    steps hold beyond the weights and the KV cache stays within ``ENGINE_OVERHEAD`` and does
    not grow with the context. (Before: a chunk's attention over a long context held every
    block of its scores at once, 0.6 GB here at 6k tokens in chunks of 512; and a row's KV
    buffer was copied to a larger one at every chunk.)"""
    model, tokenizer = many_heads
    short = beyond_weights_and_kv(model, tokenizer, 3072)
    long = beyond_weights_and_kv(model, tokenizer, 6144)
    assert long <= ENGINE_OVERHEAD, (long >> 20, short >> 20)
    assert long <= 1.2 * short, (long >> 20, short >> 20)
