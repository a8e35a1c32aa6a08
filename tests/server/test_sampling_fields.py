"""Sampling fields that reshape the target's distribution: ``logit_bias`` and
the presence, frequency and repetition penalties, applied at every position
with the context it sees before anything reads the logits, so speculation
stays lossless with them; and OpenAI fields specd does not implement yet,
refused by name instead of ignored."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.request
from collections import Counter

import openai
import pytest

from conftest import code_sample, run_engine
from specd.core.loader import load_model
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams

NGRAM = SpeculationConfig("ngram", 4, 1, 3)
DRAFT = SpeculationConfig("draft", 3)
_ids = itertools.count()


def test_a_full_logit_bias_forces_its_token(client, tokenizer):
    """+100 on one token: greedy and sampled, plain and speculating, every generated token is it."""
    token = tokenizer.encode("def")[0]
    for temperature, extra in ((0, {}), (1.0, {"seed": 3}), (0, {"speculation": {"method": "ngram"}})):
        out = client.completions.create(model="tiny", prompt="import os\n", max_tokens=8, temperature=temperature,
                                        logit_bias={str(token): 100}, logprobs=0, extra_body=extra)
        assert out.choices[0].text == tokenizer.decode([token] * 8), (temperature, extra)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logit_bias={str(token): 100})
    assert chat.choices[0].message.content == tokenizer.decode([token] * 5)


def test_logit_bias_keeps_speculation_lossless(forged):
    """Banning the tokens greedy decoding used most changes its output, and
    the new output is the same with n-gram and draft-model speculation
    (whose proposals keep offering the banned tokens) as without."""
    model, tokenizer = load_model(str(forged / "target"))
    draft, _ = load_model(str(forged / "draft"))
    ids = tokenizer.encode(code_sample("speculation"))
    prompts = [ids[:40], ids[300:330], ids[60:75] * 3]

    def serve(params, spec):
        async def go(engine):
            async def one(prompt, delay):
                await asyncio.sleep(delay)
                tokens = []
                async for out in engine.generate(GenerationRequest(f"b{next(_ids)}", prompt, params, 32, (), spec)):
                    assert out.error is None, out.error
                    tokens += out.tokens
                return tokens
            return await asyncio.gather(*(one(p, 0.01 * i) for i, p in enumerate(prompts)))
        return run_engine(model, tokenizer, go, draft, max_batch_size=4)
    unbiased = serve(SamplingParams(temperature=0), None)
    common = [t for t, _ in Counter(t for out in unbiased for t in out).most_common(3)]
    biased = SamplingParams(temperature=0, logit_bias=tuple((t, -100.0) for t in sorted(common)))
    plain = serve(biased, None)
    assert plain != unbiased and not set(common) & {t for out in plain for t in out}
    assert serve(biased, NGRAM) == plain
    assert serve(biased, DRAFT) == plain


def serve_batch(model, tokenizer, draft, prompts, params, spec, max_tokens=32):
    async def go(engine):
        async def one(prompt, delay):
            await asyncio.sleep(delay)
            tokens = []
            async for out in engine.generate(GenerationRequest(f"p{next(_ids)}", prompt, params, max_tokens, (), spec)):
                assert out.error is None, out.error
                tokens += out.tokens
            return tokens
        return await asyncio.gather(*(one(p, 0.01 * i) for i, p in enumerate(prompts)))
    return run_engine(model, tokenizer, go, draft, max_batch_size=4)


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
                                     {"repetition_penalty": 1.8}, {"frequency_penalty": 0.8, "repetition_penalty": 1.3}])
def test_penalties_change_output_and_keep_speculation_lossless(forged, penalty):
    """On repetitive prompts (where n-gram lookup proposes the repeats the
    penalties discourage), each penalty changes greedy output, and that
    output is the same with n-gram and draft-model speculation as without."""
    model, tokenizer = load_model(str(forged / "target"))
    draft, _ = load_model(str(forged / "draft"))
    ids = tokenizer.encode(code_sample("speculation"))
    prompts = [ids[60:75] * 3, ids[300:320] * 2, ids[:30]]
    plain = serve_batch(model, tokenizer, draft, prompts, SamplingParams(temperature=0), None)
    params = SamplingParams(temperature=0, **penalty)
    penalized = serve_batch(model, tokenizer, draft, prompts, params, None)
    assert penalized != plain, "the penalty changed nothing"
    assert serve_batch(model, tokenizer, draft, prompts, params, NGRAM) == penalized
    assert serve_batch(model, tokenizer, draft, prompts, params, DRAFT) == penalized


@pytest.mark.parametrize("tree", [False, True])
def test_every_verified_position_is_penalized_with_its_own_context(tree):
    """In a verify forward, position j's logits are adjusted exactly as a
    plain step's would be after the tokens j follows (a chain: the
    proposals before it; a tree: its ancestors)."""
    import mlx.core as mx
    import numpy as np

    from specd.core.sampling import adjust_logits

    rng = np.random.default_rng(0)
    B, L, V = 3, 5, 40
    params = [SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.5,
                             logit_bias=((3, 2.0),)),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, frequency_penalty=1.1)]
    prompts = [rng.integers(0, V, 6).tolist() for _ in range(B)]
    completions = [rng.integers(0, V, 4).tolist() for _ in range(B)]
    inputs = rng.integers(0, V, (B, L))
    inputs[:, 0] = [c[-1] for c in completions]
    parents = [-1, 0, 0, 1, 2]  # column -> parent column (a tree) or the chain's
    if not tree:
        parents = [-1, 0, 1, 2, 3]
    ancestry = np.zeros((B, L, L), dtype=bool)
    for j, parent in enumerate(parents):
        if parent >= 0:
            ancestry[:, j] = ancestry[:, parent]
        ancestry[:, j, j] = True
    logits = mx.array(rng.normal(size=(B, L, V)).astype(np.float32))
    got = adjust_logits(logits, params, prompts, completions, mx.array(inputs),
                        mx.array(ancestry) if tree else None)
    for b in range(B):
        for j in range(L):
            seen = [int(inputs[b, a]) for a in range(1, L) if ancestry[b, j, a]]
            want = adjust_logits(logits[b:b + 1, j:j + 1], params[b:b + 1], prompts[b:b + 1],
                                 [completions[b] + seen])
            assert np.allclose(np.array(got[b, j]), np.array(want[0, 0]), atol=1e-5), (b, j)


def test_penalties_over_http(client):
    """Penalties are accepted through the client and change what comes back;
    out-of-range values are refused by name."""
    kwargs = dict(model="tiny", prompt="def f(x):\n    return x\ndef f(x):\n", max_tokens=24, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(frequency_penalty=2.0, **kwargs).choices[0].text != plain
    for field, value in (("presence_penalty", 3), ("frequency_penalty", -2.5)):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{field: value}, **kwargs)
        assert err.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(extra_body={"repetition_penalty": 0}, **kwargs)
    assert err.value.body["param"] == "repetition_penalty"


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("prediction", {"type": "content", "content": "x"}),
    ("audio", {"voice": "alloy", "format": "wav"}),
])
def test_fields_not_implemented_yet_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert err.value.body["param"] == field and "not supported" in err.value.body["message"]


def test_no_op_values_of_those_fields_are_accepted(daemon):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [],
            "tool_choice": "none", "response_format": {"type": "text"}, "parallel_tool_calls": True}
    req = urllib.request.Request(daemon.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200 and json.loads(resp.read())["choices"][0]["message"]["content"] is not None


def prefix_hits(daemon) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(daemon.get("/metrics")[1].decode())
               for s in f.samples if s.name == "specd_prefix_cache_hits_total" and s.labels.get("model_name") == "tiny")


def test_n_choices_share_the_prompts_prefill(client, daemon, tokenizer):
    """n > 1: one choice per index, the prompt counted once in usage and
    prefilled once (the other choices start from it in the prefix cache);
    seeded choices differ from one another and come back the same on a
    repeat; streamed choices assemble to the same texts."""
    prompt = code_sample("engine")[:1200]
    prompt_tokens = len(tokenizer.encode(prompt))
    before = prefix_hits(daemon)
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.prompt_tokens == prompt_tokens
    assert greedy.usage.completion_tokens % 3 == 0 and 3 <= greedy.usage.completion_tokens <= 3 * 8
    assert prefix_hits(daemon) - before >= 2 * (prompt_tokens - 64), "the other choices prefilled again"

    messages = [{"role": "user", "content": "Write a function."}]
    sampled = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0,
                                             seed=5, n=3)
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0,
                                           seed=5, n=3)
    assert [c.message.content for c in again.choices] == texts

    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.7,
                                           seed=9, n=2)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.7,
                                            seed=9, n=2, stream=True, stream_options={"include_usage": True})
    parts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
    assert [parts[0], parts[1]] == [c.message.content for c in plain.choices]
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_a_client_leaving_an_n_choice_stream_frees_every_choice(client, daemon):
    from prometheus_client.parser import text_string_to_metric_families

    def running() -> float:
        return sum(s.value for f in text_string_to_metric_families(daemon.get("/metrics")[1].decode())
                   for s in f.samples if s.name == "specd_num_requests_running" and s.labels.get("model_name") == "tiny")
    stream = client.completions.create(model="tiny", prompt="def f(x):\n", max_tokens=1500, temperature=0.8, n=3,
                                       stream=True)
    for _, _chunk in zip(range(4), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 60
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0
