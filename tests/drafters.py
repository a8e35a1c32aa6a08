"""What the tests of drafters that read the target's features (MTP heads, DFlash drafters) share:
the same prompts, a staggered mixed batch against plain decoding, rows beside the rest of the
engine (a grammar, penalties, a warm prefix cache) and sampled output against the target's."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from conftest import code_sample, run_engine, two_sample_chi2
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.engine.scheduler import RequestRejected

GREEDY = SamplingParams(temperature=0)
NGRAM = SpeculationConfig("ngram", 3)
_ids = itertools.count()


async def generate(engine, prompt, spec=None, params=GREEDY, max_tokens=40, delay=0.0, grammar=None) -> list[int]:
    await asyncio.sleep(delay)
    request = GenerationRequest(f"r{next(_ids)}", prompt, params, max_tokens, (), spec, grammar)
    return [t async for out in engine.generate(request) for t in out.tokens]


def prompts_for(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(code_sample("eagle"))
    return [ids[i * 53: i * 53 + 10 + 5 * i] for i in range(6)] + [ids[20:36] * 3]


def mixed_batch_parity(model, tokenizer, drafter, mixes: list, sampled: list) -> tuple[list, list, int, int]:
    """Plain outputs of ``prompts_for``, and the same prompts served in a staggered batch, row i
    asking for ``mixes[i]``, beside two sampling rows asking for ``sampled``; with the proposals
    drafted and accepted."""
    rows = prompts_for(tokenizer)

    async def both(engine):
        plain = await asyncio.gather(*(generate(engine, p) for p in rows))
        params = SamplingParams(temperature=0.8, seed=5)
        mixed = await asyncio.gather(
            *(generate(engine, p, spec, delay=0.01 * (i % 3)) for i, (p, spec) in enumerate(zip(rows, mixes))),
            *(generate(engine, rows[2 * i], spec, params) for i, spec in enumerate(sampled)))
        speculator = engine.scheduler.speculator
        return plain, mixed[: len(rows)], speculator.feedback.drafted_total, speculator.feedback.accepted_total

    return run_engine(model, tokenizer, both, draft_model=drafter, max_batch_size=16)


def beside_the_engine(model, tokenizer, drafter, spec: SpeculationConfig) -> tuple[list, list, int]:
    """Outputs of a row under a JSON grammar (its forced tokens ride the proposals), a row with
    repetition and presence penalties, and plain rows, each set served twice (the second time
    from the prefix cache), plainly and with ``spec``; and the proposals drafted."""
    from specd.core.grammar import json_schema_grammar

    rows = prompts_for(tokenizer)
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    penalized = SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5)
    cases = [(rows[0], GREEDY, None), (rows[1], penalized, None), (rows[2], GREEDY, grammar), (rows[6], GREEDY, None)]

    async def serve(engine, spec):
        return [await asyncio.gather(*(generate(engine, prompt, spec, params, 32, 0.01 * i, grammar)
                                       for i, (prompt, params, grammar) in enumerate(cases))) for _ in range(2)]

    async def both(engine):
        return await serve(engine, None), await serve(engine, spec), engine.scheduler.speculator.feedback.drafted_total

    return run_engine(model, tokenizer, both, draft_model=drafter, max_batch_size=8, prefix_cache_bytes=64 << 20)


def assert_sampling_follows_the_target(model, tokenizer, drafter, spec: SpeculationConfig) -> None:
    """Two-sample chi-square on the 2nd..4th generated tokens of 300 seeded requests, ``spec``
    against plain decoding."""
    prompt = prompts_for(tokenizer)[3]
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(300)]

    async def sample(engine, spec):
        outs = await asyncio.gather(*(generate(engine, prompt, spec, p, 4) for p in params))
        return [t for out in outs for t in out[1:]]

    off = run_engine(model, tokenizer, lambda e: sample(e, None), draft_model=drafter, max_batch_size=64,
                     max_waiting=1000)
    on = run_engine(model, tokenizer, lambda e: sample(e, spec), draft_model=drafter, max_batch_size=64,
                    max_waiting=1000)
    stat, limit, dof = two_sample_chi2(off, on)
    assert stat < limit, (stat, limit, dof)


def assert_refused_without_the_drafter(model, tokenizer, spec: SpeculationConfig, reason: str) -> None:
    """A request asking for ``spec`` of a model with no such drafter is rejected, saying ``reason``."""

    async def ask(engine):
        with pytest.raises(RequestRejected, match=reason):
            await generate(engine, [1, 2, 3], spec)

    run_engine(model, tokenizer, ask)
