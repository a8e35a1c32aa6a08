"""Constrained decoding inside speculation: a grammar masks every verified
position, so greedy output is the same with and without speculation (n-gram,
draft model, EAGLE; attention, sliding-window, sink and recurrent caches; with
penalties), sampled output follows the constrained distribution, and the
tokens a grammar forces are verified in the forward that proposes them."""

from __future__ import annotations

import asyncio
import itertools
import json

import jsonschema
import pytest

from conftest import code_sample, run_engine, two_sample_chi2
from specd.core.grammar import json_schema_grammar, lark_grammar
from specd.core.loader import load_model
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams
from conftest import head_for

SCHEMA = {"type": "object", "properties": {"identifier": {"type": "string", "maxLength": 6},
                                           "temperature_celsius": {"type": "integer", "minimum": -50, "maximum": 60},
                                           "categories": {"type": "array", "items": {"enum": ["alpha", "beta"]},
                                                          "maxItems": 2},
                                           "confirmed": {"type": "boolean"}},
          "required": ["identifier", "temperature_celsius", "categories", "confirmed"],
          "additionalProperties": False}
GRAMMAR = json_schema_grammar(SCHEMA)
GREEDY = SamplingParams(temperature=0)
PENALIZED = SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5)
NGRAM = SpeculationConfig("ngram", 4, 1, 3)
DRAFT = SpeculationConfig("draft", 3)
EAGLE_TREE = SpeculationConfig("eagle", 4, tree_top_k=3, tree_tokens=10)  # a grammar's rows draft chains
_ids = itertools.count()


def prompts_of(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(code_sample("speculation"))
    return [ids[:40], ids[300:330], ids[60:75] * 3]


def serve(model, tokenizer, rows, drafter=None, max_tokens: int = 96, **config):
    """Each row (prompt, params, speculation, grammar) as a request, arriving a
    little apart; returns their tokens and the engine's speculation figures."""
    async def go(engine):
        async def one(i, prompt, params, spec, grammar):
            await asyncio.sleep(0.01 * i)
            request = GenerationRequest(f"g{next(_ids)}", prompt, params, max_tokens, (), spec, grammar)
            tokens = []
            async for out in engine.generate(request):
                assert out.error is None, out.error
                tokens += out.tokens
            return tokens
        outs = await asyncio.gather(*(one(i, *row) for i, row in enumerate(rows)))
        speculator = engine.scheduler.speculator
        forced = engine.metrics.grammar_forced_tokens.labels("t")._value.get()
        return outs, speculator.feedback.drafted_total, speculator.feedback.accepted_total, forced
    return run_engine(model, tokenizer, go, drafter, max_batch_size=8, **config)


def valid(tokenizer, tokens: list[int]) -> dict:
    text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def check_lossless(model, tokenizer, spec: SpeculationConfig, drafter=None) -> None:
    """A mixed batch (constrained rows speculating, penalised or not, and an
    unconstrained speculating row) gives each row its spec-off output."""
    prompts = prompts_of(tokenizer)
    rows = [(prompts[0], GREEDY, spec, GRAMMAR), (prompts[1], GREEDY, spec, None),
            (prompts[2], PENALIZED, spec, GRAMMAR), (prompts[1], GREEDY, spec, GRAMMAR)]
    plain, _, _, _ = serve(model, tokenizer, [(p, params, None, g) for p, params, _, g in rows], drafter)
    speculating, drafted, accepted, forced = serve(model, tokenizer, rows, drafter)
    assert speculating == plain
    for (_, _, _, grammar), tokens in zip(rows, plain):
        if grammar is not None:
            valid(tokenizer, tokens)
    assert drafted > accepted, "nothing was rolled back"
    assert forced > 0, "no forced token was verified as a proposal"


@pytest.fixture(scope="module")
def pair(forged):
    model, tokenizer = load_model(str(forged / "target"))
    draft, _ = load_model(str(forged / "draft"))
    return model, tokenizer, draft


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_greedy_output_under_a_grammar_is_the_same_with_and_without_speculation(pair, method):
    model, tokenizer, draft = pair
    if method == "ngram":
        check_lossless(model, tokenizer, NGRAM)
    elif method == "draft":
        check_lossless(model, tokenizer, DRAFT, draft)
    else:
        check_lossless(model, tokenizer, EAGLE_TREE, head_for(model, 3))


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "qwen3_next", "lfm2"])
def test_grammar_speculation_is_lossless_on_every_cache_kind(family, family_models):
    """Sliding windows (Gemma 3), sinks and alternating windows (gpt-oss),
    recurrent state (Qwen3-Next) and short convolutions (LFM2)."""
    model, tokenizer = load_model(str(family_models(family)))
    check_lossless(model, tokenizer, NGRAM)


def test_forced_tokens_cost_no_round_of_their_own(pair):
    """Without any speculation, a schema's key names, quotes and braces come
    in the forward that proposes them: far fewer decode steps than tokens."""
    model, tokenizer, _ = pair
    steps = 0

    def counting(engine):
        runner = engine.scheduler.runner
        original = runner.decode

        def decode(batch, deliver):
            nonlocal steps
            steps += 1
            original(batch, deliver)
        runner.decode = decode
        request = GenerationRequest(f"g{next(_ids)}", prompts_of(tokenizer)[0], GREEDY, 96, (), None, GRAMMAR)
        return collect(engine, request)
    tokens = run_engine(model, tokenizer, counting)
    valid(tokenizer, tokens)
    assert steps < len(tokens) / 2, (steps, len(tokens))


async def collect(engine, request) -> list[int]:
    return [t async for out in engine.generate(request) for t in out.tokens]


def test_a_seeded_request_samples_the_same_whatever_forced_width_a_round_takes(pair):
    """How many forced tokens a round carries is the cost model's choice, from
    measured step times (a busy machine changes it); a seeded, sampled request
    under a grammar gives the same tokens whether every round carries all its
    forced tokens, none (each comes from a plain step), or one."""
    model, tokenizer, _ = pair
    params = SamplingParams(temperature=1.0, seed=11)

    def sampled(width) -> list[int]:
        def go(engine):
            speculator = engine.scheduler.speculator
            speculator._forced_width = lambda drafts, forced: width(drafts, forced)
            request = GenerationRequest(f"g{next(_ids)}", prompts_of(tokenizer)[0], params, 96, (), None, GRAMMAR)
            return collect(engine, request)
        return run_engine(model, tokenizer, go)
    every = sampled(lambda drafts, forced: max(len(d) for d in drafts))
    valid(tokenizer, every)
    assert sampled(lambda drafts, forced: max(len(d) - f for d, f in zip(drafts, forced))) == every
    assert sampled(lambda drafts, forced: max(len(d) - f for d, f in zip(drafts, forced)) + 1) == every


@pytest.mark.parametrize("spec", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_sampled_output_under_a_grammar_follows_the_constrained_distribution(pair, spec):
    """Two-sample chi-square on the 2nd..4th tokens (the first comes from
    prefill) under a grammar that leaves a handful of choices at each
    position: speculating vs not, 300 seeds each (4 tokens each: the
    speculator drafts within what a request has left)."""
    model, tokenizer, draft = pair
    grammar = lark_grammar('start: "x" WORD WORD WORD\nWORD: /[a-e]+ /\n')
    prompt = prompts_of(tokenizer)[1]

    def sample(speculation):
        rows = [(prompt, SamplingParams(temperature=1.0, seed=s), speculation, grammar) for s in range(300)]
        outs, _, _, _ = serve(model, tokenizer, rows, draft, max_tokens=4, max_waiting=1000)
        return [t for out in outs for t in out[1:4]]
    stat, limit, dof = two_sample_chi2(sample(None), sample(spec))
    assert stat < limit, (stat, limit, dof)


def test_an_end_of_sequence_in_a_proposal_leaves_the_matcher_where_it_was(tokenizer):
    """The matcher does not count an end-of-sequence token it stops on, so
    checking, masking and drafting over a proposal that ends the output must
    not consume one (rolling back would then undo an accepted token)."""
    from specd.core.grammar import Constraint, grammar_tokenizer
    import numpy as np

    eos = sorted(tokenizer.eos_token_ids)
    constraint = Constraint(json_schema_grammar(SCHEMA), grammar_tokenizer(tokenizer, len(tokenizer), eos), eos)
    document = tokenizer.encode(json.dumps({"identifier": "ab", "temperature_celsius": 3, "categories": [],
                                            "confirmed": True}, separators=(",", ":")))
    constraint.advance(document[:-2])
    proposal = document[-2:] + [eos[0]]
    assert constraint.extend(proposal, 8, sampled_from_q=False) == (proposal, 0)
    constraint.masks(proposal, np.empty((len(proposal) + 1, (len(tokenizer) + 31) // 32), dtype=np.int32))
    assert all(constraint.step(t) for t in document[-2:]) and not constraint.step(eos[0])
    constraint.rewind(2)
    constraint.advance(proposal)
    assert not constraint.matcher.is_error() and constraint.matcher.is_stopped()
