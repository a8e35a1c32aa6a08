"""Sampling fields that reshape the target's distribution: ``logit_bias``,
applied at every position before anything reads the logits, so speculation
stays lossless with it; and OpenAI fields specd does not implement yet,
refused by name instead of ignored."""

from __future__ import annotations

import asyncio
import itertools
import json
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


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("functions", [{"name": "f"}]),
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
