"""Speculative decoding inside continuous batching, on the forged test pair.

Greedy parity is the contract: whatever the proposer, batch mates, k or
arrival times, greedy output is token-identical to the spec-off engine.
"""

from __future__ import annotations

import asyncio
import copy
import itertools

import mlx.core as mx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.core.loader import check_draft_pair
from conftest import code_sample, run_engine, two_sample_chi2
from specd.core.sampling import SamplingParams
from specd.core.request import GenerationRequest
from specd.core.request import SpeculationConfig
from specd.speculation.config import PolicySettings

GREEDY = SamplingParams(temperature=0)
NGRAM = SpeculationConfig("ngram", 4, 1, 4)
DRAFT = SpeculationConfig("draft", 3)
_ids = itertools.count()


@pytest.fixture(scope="module")
def prompts(pair) -> list[list[int]]:
    """Code prompts, several of them repetitive so n-gram lookup finds matches."""
    tokenizer = pair[1]
    text = code_sample("speculation")
    ids = tokenizer.encode(text)
    out = [ids[i * 97: i * 97 + 20 + 9 * i] for i in range(12)]
    out += [ids[40:70] * 3, ids[500:520] * 4]
    return out


async def generate(engine, prompt, spec=None, params=GREEDY, max_tokens=160, delay=0.0, stop=()):
    if delay:
        await asyncio.sleep(delay)
    request = GenerationRequest(f"r{next(_ids)}", prompt, params, max_tokens, tuple(stop), spec)
    tokens, text, last = [], [], None
    async for out in engine.generate(request):
        tokens += out.tokens
        text.append(out.text)
        last = out
    return tokens, "".join(text), last


def serve(pair, fn, draft_model="draft", tokenizer=None, **config):
    target, tok, draft = pair
    draft_model = {"draft": draft, "target": target, None: None}[draft_model]
    return run_engine(target, tokenizer or tok, fn, draft_model, **config)


@pytest.fixture(scope="module")
def reference(pair, prompts):
    """Spec-off greedy output of every prompt, each decoded alone."""
    async def go(engine):
        return [(await generate(engine, p))[0] for p in prompts]
    return serve(pair, go, draft_model=None)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT, SpeculationConfig("draft", 6), SpeculationConfig("ngram", 1)],
                         ids=["ngram4", "draft3", "draft6", "ngram1"])
def test_greedy_parity_alone(pair, prompts, reference, spec):
    async def go(engine):
        return [await generate(engine, p, spec) for p in prompts]
    results = serve(pair, go)
    assert [r[0] for r in results] == reference
    assert sum(r[2].spec.accepted for r in results) > 0


def test_greedy_parity_in_mixed_batches_joining_mid_flight(pair, prompts, reference):
    """Spec and non-spec requests, n-gram and draft, different k and
    temperatures side by side, arriving while others decode."""
    specs = [None, NGRAM, DRAFT, SpeculationConfig("draft", 5), SpeculationConfig("ngram", 2, 2, 3),
             SpeculationConfig("none")]

    async def go(engine):
        greedy = [generate(engine, p, specs[i % len(specs)], delay=0.015 * i) for i, p in enumerate(prompts)]
        sampled = [generate(engine, p, DRAFT, SamplingParams(temperature=0.8, top_p=0.9, seed=i), 60, 0.01 * i)
                   for i, p in enumerate(prompts[:4])]
        results = await asyncio.gather(*greedy, *sampled)
        return results[: len(prompts)]

    results = serve(pair, go, max_batch_size=8, prefill_step_tokens=64)
    assert [r[0] for r in results] == reference


def test_rows_with_nothing_to_prefill(pair, prompts):
    """A prefill runs over a context's every token but the last, which the decode step feeds. A
    one-token prompt has nothing to prefill, and neither has a prompt the prefix cache holds whole
    (asked again): alone, and beside longer rows, plain, n-gram and draft give the greedy tokens of
    mlx-lm's own generator."""
    from mlx_lm.generate import generate_step
    target, tokenizer = pair[0], pair[1]
    shorts = [[prompts[0][0]], [prompts[5][3]], prompts[2]]
    expected = []
    for p in shorts:
        tokens = [t for t, _ in generate_step(mx.array(p), target, max_tokens=24)]
        ends = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
        expected.append(tokens[: ends[0] + 1] if ends else tokens)  # the engine stops at EOS

    async def go(engine):
        alone = [await generate(engine, p, max_tokens=24) for p in shorts]
        batched = await asyncio.gather(*(generate(engine, p, spec, max_tokens=24, delay=0.01 * i)
                                         for i, (p, spec) in enumerate(itertools.product(shorts + prompts[6:8],
                                                                                          [None, NGRAM, DRAFT]))))
        return alone, batched[: 3 * len(shorts)]
    alone, batched = serve(pair, go, max_batch_size=8)
    assert [a[0] for a in alone] == expected
    assert [b[0] for b in batched] == [e for e in expected for _ in range(3)]
    assert alone[2][2].cached_tokens == 0 and all(b[2].cached_tokens == len(shorts[2]) - 1 for b in batched[6:])


def test_eos_inside_an_accepted_run(pair, prompts, reference):
    """The draft is the target itself, so every proposal is accepted; making a
    token that greedy decoding reaches an EOS puts the EOS mid-run."""
    tokens = reference[3]
    eos = tokens[5]
    cut = tokens.index(eos) + 1
    tokenizer = copy.copy(pair[1])
    tokenizer.eos_token_ids = {eos}

    async def go(engine):
        return await generate(engine, prompts[3], SpeculationConfig("draft", 4))
    out, _, last = serve(pair, go, draft_model="target", tokenizer=tokenizer)
    assert out == tokens[:cut]
    assert last.finish_reason == "stop" and last.spec.accepted > 0


def test_max_tokens_and_stop_strings_mid_round(pair, prompts, reference):
    tokenizer = pair[1]
    full = tokenizer.decode(reference[5])
    stop = full[37:41]
    expected_text = full[: full.index(stop)]

    async def go(engine):
        spec = SpeculationConfig("draft", 6)
        short = [await generate(engine, prompts[5], spec, max_tokens=n) for n in (1, 2, 5, 9)]
        stopped = await generate(engine, prompts[5], spec, stop=[stop])
        return short, stopped
    short, stopped = serve(pair, go, draft_model="target")
    for (tokens, _, last), n in zip(short, (1, 2, 5, 9)):
        assert tokens == reference[5][:n] and last.finish_reason == "length"
    assert stopped[1] == expected_text and stopped[2].finish_reason == "stop"


def test_context_limit_shrinks_then_stops_speculation(pair, prompts, reference):
    prompt = prompts[6]
    limit = len(prompt) + 11

    async def go(engine):
        return await generate(engine, prompt, SpeculationConfig("draft", 4))
    tokens, _, last = serve(pair, go, draft_model="target", max_context=limit)
    assert tokens == reference[6][:11] and last.finish_reason == "length"
    # 10 tokens after the first fit k = 4, 4, then 0: the last round decodes plainly
    assert last.spec.drafted <= 10


def test_seeded_sampling_is_batch_invariant_with_speculation(pair, prompts):
    params = SamplingParams(temperature=1.0, top_k=50, seed=99)

    async def go(engine):
        alone = await generate(engine, prompts[1], DRAFT, params, 48)
        batched = await asyncio.gather(generate(engine, prompts[1], DRAFT, params, 48),
                                       *(generate(engine, p, NGRAM, max_tokens=48) for p in prompts[2:6]))
        return alone[0], batched[0][0]
    alone, batched = serve(pair, go)
    assert alone == batched


def test_a_seeded_row_proposes_its_lookup_where_the_draft_model_drafts_for_its_batch_mates(pair, prompts):
    """A draft pairing's seeded sampling row whose prompt lookup covers its k proposes the
    lookup even in a round where the draft model drafts for its batch mates, and the round
    leaves its RNG key as it was: drafting for it would advance the key, and a seeded row
    draws the same stream alone or batched."""
    params = SamplingParams(temperature=1.0, top_k=50, seed=7)
    kept = []

    async def go(engine):
        drafter = engine.scheduler.speculator.drafter
        propose = drafter.propose

        def record(round_):
            seeded = [i for i in round_.lookups if round_.seqs[i].params.seed is not None]
            before = [round_.seqs[i].key for i in seeded]
            drafts = propose(round_)
            kept.extend(mx.array_equal(round_.seqs[i].key, key).item() for i, key in zip(seeded, before))
            return drafts
        drafter.propose = record
        await asyncio.gather(generate(engine, prompts[12], DRAFT, params, 48),
                             *(generate(engine, p, DRAFT, max_tokens=48) for p in prompts[2:6]))
    serve(pair, go)
    assert kept and all(kept)


@pytest.mark.parametrize("spec", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_sampled_tokens_follow_the_target_end_to_end(pair, prompts, spec):
    """Two-sample chi-square on the 2nd..4th generated tokens (the first comes
    from prefill, later ones from verification): spec-on vs spec-off."""
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(300)]
    prompt = prompts[12]

    async def sample(engine, speculation):
        outs = await asyncio.gather(*(generate(engine, prompt, speculation, p, 4) for p in params))
        return [tok for t, _, _ in outs for tok in t[1:]]

    off = serve(pair, lambda e: sample(e, None), max_batch_size=64, max_waiting=1000)
    on = serve(pair, lambda e: sample(e, spec), max_batch_size=64, max_waiting=1000)
    stat, limit, dof = two_sample_chi2(off, on)
    assert stat < limit, (stat, limit, dof)


def test_mismatched_draft_vocabulary_is_refused(pair, forged):
    from specd.forge.llama import LlamaShape, build

    target, tokenizer, _ = pair
    other = build(LlamaShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=64, vocab_size=target.args.vocab_size + 7))
    with pytest.raises(ValueError, match="vocabulary"):
        check_draft_pair(target, tokenizer, other, tokenizer, "bad")


@pytest.mark.parametrize("policy", [
    PolicySettings(mode="static", disable_by_batch_size=3, max_speculative_tokens=3),
    PolicySettings(mode="goodput", max_speculative_tokens=4, probe_interval=3),
], ids=["static-toggling", "goodput"])
def test_greedy_parity_while_a_policy_toggles_speculation(pair, prompts, reference, policy):
    """Rows stop and resume drafting as the batch grows and shrinks; the draft
    cache catches up on what they emitted meanwhile, and output never changes."""
    async def go(engine):
        engine.set_policy(policy, "p")
        specs = [DRAFT, SpeculationConfig("draft", 4), NGRAM]
        return await asyncio.gather(*(generate(engine, p, specs[i % 3], delay=0.03 * i)
                                      for i, p in enumerate(prompts)))
    results = serve(pair, go, max_batch_size=6)
    assert [r[0] for r in results] == reference


def test_draft_rows_propose_their_prompt_lookups_where_the_draft_model_does_not_run(pair, prompts, reference):
    """A draft pairing's rows propose their prompt lookups (free) in a round where every
    drafting row's lookup covers its k; where some row needs the draft model, it drafts for
    every row but seeded sampling ones (its proposals are accepted more often): repetitive
    prompts speculate through both, greedy and sampled side by side, with the reference's
    greedy tokens; the lookups' tokens are counted under ``ngram``, the draft model's under
    ``draft``."""
    rounds = []

    async def go(engine):
        speculator = engine.scheduler.speculator
        plan = speculator._plan

        def record(*args):
            round_ = plan(*args)
            rounds.append(round_)
            return round_
        speculator._plan = record
        greedy = [generate(engine, p, DRAFT, delay=0.01 * i) for i, p in enumerate(prompts[10:])]
        sampled = [generate(engine, p, DRAFT, SamplingParams(temperature=0.8, seed=i), 60)
                   for i, p in enumerate(prompts[12:])]
        results = await asyncio.gather(*greedy, *sampled)
        text = generate_latest(engine.metrics.registry).decode()
        return results[:len(prompts) - 10], text
    results, text = serve(pair, go, max_batch_size=8)
    assert [r[0] for r in results] == reference[10:]
    tokens = {s.labels["method"]: s.value for f in text_string_to_metric_families(text)
              if f.name == "specd_spec_decode_num_draft_tokens" for s in f.samples if s.name.endswith("_total")}
    assert tokens.get("ngram", 0) > 0 and tokens.get("draft", 0) > 0, tokens
    # a round proposed lookups only where the draft model did not run, but a seeded row's (whose
    # RNG drafting would advance)
    assert any(round_.lookups for round_ in rounds)
    assert all(round_.seqs[i].params.seed is not None for round_ in rounds if any(round_.model_ks)
               for i in round_.lookups)


def test_empty_lookups_still_teach_the_estimates(pair):
    """An n-gram row planned to speculate whose lookup finds nothing (so the step verifies
    nothing) still counts against the k chosen: the goodput controller sees the round."""
    rounds = []

    async def go(engine):
        engine.set_policy(PolicySettings(mode="goodput", max_speculative_tokens=4), "p")
        await asyncio.sleep(0.05)  # swapped in between steps; the engine is idle
        controller = engine.scheduler.speculator.feedback.controller
        observe = controller.observe

        def record(estimates, proposed, accepted, planned):
            rounds.append((list(proposed), list(planned)))
            observe(estimates, proposed, accepted, planned)
        controller.observe = record
        await generate(engine, list(range(5, 45)), NGRAM, max_tokens=64)  # no repeats to look up at first
    serve(pair, go, draft_model=None)
    assert any(not any(proposed) and any(planned) for proposed, planned in rounds)


def test_each_drafter_learns_apart_and_gets_back_what_it_learned(pair, prompts):
    """What a drafter's rounds taught (acceptance by position, what its draft steps cost, whole
    steps measured at each k) is its own: another drafter attached decides from nothing of it,
    and the first attached again decides from what it learned before."""
    target, _, draft = pair
    goodput = PolicySettings(mode="goodput", max_speculative_tokens=4)

    async def attach(engine, drafter):
        engine.configure_speculation(DRAFT, drafter)
        while engine.drafter_module is not drafter:  # between steps
            await asyncio.sleep(0.001)

    async def go(engine):
        feedback = engine.scheduler.speculator.feedback
        engine.set_policy(goodput, "p")
        await asyncio.gather(*(generate(engine, p, DRAFT, max_tokens=48) for p in prompts[:4]))
        first = feedback.learning
        await attach(engine, target)  # the target drafting for itself: another drafter
        # read once the engine applied the swap: every request of the first drafter had left
        learned = (first.history.by_position(), first.draft.params(), sorted(first.realised))
        fresh = (feedback.history.by_position(), feedback.costs.draft.seen, sorted(feedback.realised))
        await asyncio.gather(*(generate(engine, p, DRAFT, max_tokens=24) for p in prompts[4:6]))
        second = feedback.learning
        await attach(engine, draft)
        back = feedback.learning
        return learned, fresh, first, second, back, feedback
    learned, fresh, first, second, back, feedback = serve(pair, go)
    assert learned[0] and learned[1] != (0.0, 0.0) and learned[2], "the draft model's rounds taught nothing"
    assert fresh == ([], False, []), "the next drafter started from the draft model's learning"
    assert second is not first and second.draft.seen, "the target's own rounds were not learned apart"
    assert back is first and feedback.costs.draft is first.draft
    assert (first.history.by_position(), first.draft.params(), sorted(first.realised)) == learned
    assert feedback.controller.realised is first.realised and feedback.controller.history is first.history


def test_finished_requests_seed_the_next_ones_across_a_policy_swap(pair, prompts):
    """A request that leaves hands its acceptance by position to the model's history, and a
    policy swap keeps that history: the next request starts from what the last ones saw."""
    goodput = PolicySettings(mode="goodput", max_speculative_tokens=4)

    async def go(engine):
        engine.set_policy(goodput, "p")
        await generate(engine, prompts[0], DRAFT, max_tokens=64)
        await generate(engine, prompts[1], DRAFT, max_tokens=8)  # a decode step after the first left
        engine.set_policy(PolicySettings(mode="static"), "p")
        await asyncio.sleep(0.05)  # swapped in between steps; the engine is idle
        return engine.scheduler.speculator
    speculator = serve(pair, go)
    pooled = speculator.feedback.history.by_position()
    assert pooled, "the first request's estimate was not absorbed when it left"
    seeded = speculator.feedback.controller.new_estimate()
    assert [seeded.at(i) for i in range(len(pooled))] == pytest.approx(pooled)
    assert speculator.status()["acceptanceByPosition"] == pytest.approx(pooled, abs=1e-4)  # describe shows it
