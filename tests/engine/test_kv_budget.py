"""The KV budget (kvCache.maxBytes): admission counts memory, and when the
running rows outgrow the budget the newest are preempted and recomputed
later, their output unchanged whatever the speculation."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from conftest import code_sample, head_for, run_engine
from specd.api.manifest import ManifestError, parse_documents
from specd.core import layout
from specd.core.cache import kv_bytes
from specd.core.columns import STEP
from specd.core.kv import RowKV, _rounded
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.engine.scheduler import RequestRejected

GREEDY = SamplingParams(temperature=0)
_ids = itertools.count()


@pytest.fixture(scope="module")
def prompts(pair) -> list[list[int]]:
    ids = pair[1].encode(code_sample("speculation"))
    return [ids[i * 83: i * 83 + 18 + 9 * i] for i in range(5)] + [ids[40:60] * 3]


async def generate(engine, prompt, spec=None, params=GREEDY, max_tokens=110, delay=0.0) -> list[int]:
    await asyncio.sleep(delay)
    request = GenerationRequest(f"k{next(_ids)}", prompt, params, max_tokens, (), spec)
    return [t async for out in engine.generate(request) for t in out.tokens]


def serve(model, tokenizer, prompts, specs, params=GREEDY, drafter=None, **config):
    """Every prompt at once (staggered a little), with its speculation; outputs and the KV status."""
    async def go(engine):
        outs = await asyncio.gather(*(generate(engine, p, s, params, delay=0.01 * (i % 3))
                                      for i, (p, s) in enumerate(zip(prompts, specs))))
        return outs, engine.kv_cache_status()
    return run_engine(model, tokenizer, go, drafter, max_batch_size=8, **config)


CASES = {
    "plain": (None, lambda pair: None),
    "ngram": (SpeculationConfig("ngram", 3), lambda pair: None),
    "draft": (SpeculationConfig("draft", 3), lambda pair: pair[2]),
    "eagle_tree": (SpeculationConfig("eagle", 3, tree_top_k=3, tree_tokens=8), lambda pair: head_for(pair[0], 3)),
}


@pytest.mark.parametrize("prefix_cache", [None, 0], ids=["prefix_cache", "no_prefix_cache"])
@pytest.mark.parametrize("case", list(CASES))
def test_preempted_requests_give_the_same_tokens(pair, prompts, case, prefix_cache):
    """A budget that holds about two of six growing rows: rows are preempted,
    resumed (from the prefix cache, or recomputed from scratch without one)
    and every request's greedy tokens equal an unbounded run's; the rows never
    hold more than the budget."""
    model, tokenizer, _ = pair
    spec, make_drafter = CASES[case]
    drafter = make_drafter(pair)
    specs = [spec, None, spec, spec, None, spec]
    unbounded, _ = serve(model, tokenizer, prompts, specs, drafter=drafter, prefix_cache_bytes=prefix_cache)
    token_bytes = kv_bytes(model)[0] + (kv_bytes(drafter)[0] if case == "draft" else 0)
    bounded, status = serve(model, tokenizer, prompts, specs, drafter=drafter, prefix_cache_bytes=prefix_cache,
                            kv_cache_bytes=token_bytes * 64 * 7)
    assert status["preemptions"] > 0 and 0 < status["peakBytes"] <= status["maxBytes"]
    assert bounded == unbounded


def test_a_block_pads_shorter_rows_only_within_the_room_the_budget_has(pair, prompts, monkeypatch):
    """Rows laid out as one block pad the shorter ones to the longest: that is taken where the KV
    budget has room for the padding beside what it charges the rows, and never past it; the tokens
    are the same either way."""
    model, tokenizer, _ = pair
    monkeypatch.setattr(layout, "LAYOUT", "block")  # a block wherever the budget allows one
    weighed = []  # per forward of several rows: (laid out as a block, padding past the rows' charges, room)
    block_pays = RowKV._block_pays

    def watched(self: RowKV, width: int) -> bool:
        taken = block_pays(self, width)
        if len(self.held) > 1 and not any(self.pending) and not any(self.shared_columns):
            charged = sum(_rounded(h + STEP) for h in self.held)  # a round's growth each
            weighed.append((taken, _rounded(max(self.held) + width) * len(self.held) - charged, self.room))
        return taken
    monkeypatch.setattr(RowKV, "_block_pays", watched)
    mixed = [prompts[0][:6], prompts[1], prompts[5] * 4, prompts[3]]  # 6 to 240 tokens
    outputs = {}
    for budget in (None, kv_bytes(model)[0] * 64 * 12):
        weighed.clear()
        outputs[budget], status = serve(model, tokenizer, mixed, [None] * 4, kv_cache_bytes=budget)
        assert all(padding <= room for taken, padding, room in weighed if taken)
        assert status["peakBytes"] <= status["maxBytes"]
        if budget is None:
            assert any(taken and padding > 0 for taken, padding, _ in weighed)
        else:
            assert any(not taken and padding > room for taken, padding, room in weighed)
    assert outputs[None] == outputs[kv_bytes(model)[0] * 64 * 12]


def test_sampled_requests_keep_their_tokens_through_preemption(pair, prompts):
    """Each request's RNG advances only when it samples, so a seeded request
    preempted and resumed samples exactly what it would have."""
    model, tokenizer, _ = pair
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    unbounded, _ = serve(model, tokenizer, prompts, [None] * 6, params)
    bounded, status = serve(model, tokenizer, prompts, [None] * 6, params,
                            kv_cache_bytes=kv_bytes(model)[0] * 64 * 7)
    assert status["preemptions"] > 0
    assert bounded == unbounded


def test_a_prompt_the_budget_cannot_hold_is_refused_with_the_numbers(pair):
    model, tokenizer, _ = pair
    token_bytes = kv_bytes(model)[0]

    async def go(engine):
        status = engine.kv_cache_status()
        with pytest.raises(RequestRejected) as refused:
            engine.check_prompt(GenerationRequest("big", [5] * 300, GREEDY, 4))
        return status, str(refused.value), refused.value.field, await generate(engine, [5] * 20, max_tokens=8)
    status, message, field, tokens = run_engine(model, tokenizer, go, kv_cache_bytes=token_bytes * 256)
    assert status["maxBytes"] == token_bytes * 256 and status["maxTokens"] == 192 and not status["reserved"]
    assert field == "prompt" and "kvCache.maxBytes" in message and "holds 192" in message, message
    assert len(tokens) == 8


def test_kv_cache_max_bytes_in_a_manifest():
    def model(spec: str):
        return parse_documents(f"apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {{name: m}}\n"
                              f"spec: {{source: x, {spec}}}\n")
    assert model("kvCache: {maxBytes: 2Gi}")[0].spec.kv_cache_max_bytes == 2 << 30
    assert model("maxBatchSize: 2")[0].spec.kv_cache_max_bytes is None
    for spec, path in [("kvCache: {maxBytes: 0}", "spec.kvCache.maxBytes"),
                       ("kvCache: {maxBytes: lots}", "spec.kvCache.maxBytes"),
                       ("kvCache: {bytes: 1}", "spec.kvCache.bytes"),
                       ("task: embed, kvCache: {maxBytes: 1Gi}", "spec.kvCache")]:
        with pytest.raises(ManifestError) as refused:
            model(spec)
        assert refused.value.path == path, (spec, refused.value.path)
