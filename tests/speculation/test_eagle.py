"""EAGLE inside continuous batching, on the forged test target.

Greedy parity is the contract for chain and tree drafting alike: whatever the
head proposes, output is token-identical to the spec-off engine, in batches
mixing EAGLE chains, EAGLE trees, n-gram, sampled and plain rows.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from conftest import code_sample, head_for, run_engine
from drafters import assert_refused_without_the_drafter
from specd.core.sampling import SamplingParams
from specd.core.request import GenerationRequest
from specd.core.request import SpeculationConfig
from specd.speculation.eagle.checkpoint import load_head, save_head
from specd.speculation.eagle.head import EagleHead

GREEDY = SamplingParams(temperature=0)
_ids = itertools.count()


def published(head: EagleHead, target, directory: Path) -> EagleHead:
    """The head written in the published checkpoint layout and loaded back, as a DraftPairing loads it."""
    save_head(head, directory)
    return load_head(directory, target)


@pytest.fixture(scope="module")
def target(forged):
    return load(str(forged / "target"))


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    ids = target[1].encode(code_sample("eagle"))
    return [ids[i * 61: i * 61 + 12 + 7 * i] for i in range(6)] + [ids[30:50] * 3]


async def generate(engine, prompt, spec=None, params=GREEDY, max_tokens=48, delay=0.0) -> list[int]:
    await asyncio.sleep(delay)
    request = GenerationRequest(f"e{next(_ids)}", prompt, params, max_tokens, (), spec)
    return [t async for out in engine.generate(request) for t in out.tokens]


CHAIN = SpeculationConfig("eagle", 4)
TREE = SpeculationConfig("eagle", 4, tree_top_k=3, tree_tokens=10)
WIDE = SpeculationConfig("eagle", 3, tree_top_k=4, tree_tokens=6)
NGRAM = SpeculationConfig("ngram", 3)


@pytest.mark.parametrize("version", [1, 3])
def test_greedy_parity_for_chains_and_trees_in_mixed_batches(target, prompts, version, tmp_path):
    model, tokenizer = target
    head = published(head_for(model, version), model, tmp_path)

    rows = prompts + [prompts[1][:1]]  # and a one-token prompt: nothing to prefill, no features to draft from

    async def both(engine):
        plain = await asyncio.gather(*(generate(engine, p) for p in rows))
        mixes = [CHAIN, TREE, None, NGRAM, WIDE, TREE, CHAIN, TREE]
        sampled = SamplingParams(temperature=0.8, seed=3)
        mixed = await asyncio.gather(
            *(generate(engine, p, spec, delay=0.01 * (i % 3)) for i, (p, spec) in enumerate(zip(rows, mixes))),
            generate(engine, prompts[2], TREE, sampled), generate(engine, prompts[0], CHAIN, sampled))
        status = engine.scheduler.speculator.feedback
        return plain, mixed[: len(rows)], status.accepted_total, status.drafted_total

    plain, mixed, accepted, drafted = run_engine(model, tokenizer, both, draft_model=head, max_batch_size=16)
    assert all(len(p) == 48 for p in plain[: len(prompts)])
    assert mixed == plain
    assert drafted > 0 and accepted > 0  # trees were verified and some branches kept


def test_requests_asking_for_eagle_need_a_head(target):
    assert_refused_without_the_drafter(*target, CHAIN, "no EAGLE head")


@pytest.mark.parametrize("version", [1, 3])
def test_draft_steps_see_the_context_and_their_own_ancestors_only(target, version):
    """Siblings share a position, and a node's output is the head's causal
    output over the context followed by its own branch."""
    from specd.core.kv import RowKV

    head = head_for(target[0], version)
    H = head.config.hidden_size
    hidden, embeds = mx.random.normal((1, 8, H), key=mx.random.key(1)), mx.random.normal((1, 8, H), key=mx.random.key(2))
    cache = RowKV([0])
    head(hidden[:, :5], embeds[:, :5], cache)
    siblings, nodes = head.draft_step(hidden[:, 5:7], embeds[:, 5:7], cache, 1, None, mx.eye(2, dtype=mx.bool_)[None])
    child, _ = head.draft_step(hidden[:, 7:8], embeds[:, 7:8], cache, 2, nodes, mx.array([[[False, True, True]]]))

    def alone(columns: list[int]) -> mx.array:
        return head(hidden[:, columns], embeds[:, columns])[0, -1]

    for got, branch in [(siblings[0, 0], [5]), (siblings[0, 1], [6]), (child[0, 0], [6, 7])]:
        assert mx.abs(got - alone([0, 1, 2, 3, 4] + branch)).max().item() < 1e-4


def test_rows_that_sit_out_keep_their_features_and_draft_later(target, prompts):
    """Under a policy that stops speculation while 3 or more requests decode,
    EAGLE rows start drafting only when the batch shrinks: the head must then
    have every feature of their context (each request drafts), and output stays identical."""
    from specd.speculation.config import PolicySettings

    model, tokenizer = target
    head = head_for(model, 1)
    policy = PolicySettings(mode="static", disable_by_batch_size=3, max_speculative_tokens=4)

    async def with_rounds(engine, prompt, spec, max_tokens, delay):
        await asyncio.sleep(delay)
        request = GenerationRequest(f"e{next(_ids)}", prompt, GREEDY, max_tokens, (), spec)
        tokens, rounds = [], 0
        async for out in engine.generate(request):
            tokens += out.tokens
            rounds = out.spec.rounds if out.spec is not None else rounds
        return tokens, rounds

    async def both(engine):
        plain = await asyncio.gather(*(generate(engine, p, max_tokens=24 + 8 * i) for i, p in enumerate(prompts)))
        engine.set_policy(policy, "p")
        await asyncio.sleep(0.05)
        specs = [CHAIN, TREE, CHAIN, WIDE]
        spec = await asyncio.gather(*(with_rounds(engine, p, specs[i % 4], 24 + 8 * i, 0.02 * i)
                                      for i, p in enumerate(prompts)))
        return plain, spec

    plain, spec = run_engine(model, tokenizer, both, draft_model=head, max_batch_size=8)
    assert [tokens for tokens, _ in spec] == plain
    assert all(rounds > 0 for _, rounds in spec[-2:]), [r for _, r in spec]  # drafted once the batch was small


def test_a_row_that_has_not_drafted_yet_keeps_its_features_while_others_draft(target, prompts):
    """The head is fed each sequence's whole context exactly once, whenever it first drafts
    (a step the controller leaves out of its timings); a backlog plain steps left is timed apart."""
    import copy

    from specd.core.cache import make_row_cache
    from specd.core.prefix import RowPrefixes
    from specd.core.sequence import Sequence
    from specd.speculation.eagle.proposer import EagleProposer
    from specd.speculation.proposer import Outcome, Round

    model, tokenizer = target
    proposer = EagleProposer(head_for(model, 1), model, RowPrefixes(None, []))
    eagle = SpeculationConfig("eagle", 3, tree_top_k=2, tree_tokens=4)
    seqs = [Sequence(GenerationRequest(f"e{next(_ids)}", p, GREEDY, 16), lambda out: None,
                     copy.copy(tokenizer.detokenizer), frozenset(tokenizer.eos_token_ids), 2048)
            for p in prompts[:2]]
    width = max(len(s.prompt) for s in seqs)
    padding = [width - len(s.prompt) for s in seqs]
    cache = make_row_cache(model, padding)
    model(mx.array([[0] * p + s.prompt for p, s in zip(padding, seqs)]), cache=cache.layers)
    proposer.prefilled(seqs, [eagle, eagle], [list(range(p, width)) for p in padding], started=True)
    for s in seqs:
        s.tokens.append(7)  # the prefill's sampled token
    first, second = seqs

    def plain_step(token: int) -> None:
        """A decode step in which no row kept a proposal."""
        model(mx.array([[token], [token]]), cache=cache.layers)
        proposer.commit(Round(seqs, [token] * 2, [eagle, eagle], [0, 0]),
                        Outcome([0, 0], [[token], [token]], [[0], [0]]))
        for s in seqs:
            s.tokens.append(token)

    proposer.propose(Round(seqs, [7, 7], [eagle, eagle], [3, 0]))
    assert proposer.rows.state[first] == len(first.prompt) and proposer.can_draft(second)
    assert second not in proposer.rows
    plain_step(8)
    drafts = proposer.propose(Round(seqs, [8, 8], [eagle, eagle], [3, 3]))
    assert proposer.rows.state[second] == len(second.prompt) + 1 and len(drafts.trees[1].tokens) == 4
    assert proposer.caught_up
    for steps, backlog in ((1, False), (2, False), (3, True)):  # plain steps since the last round
        for _ in range(steps):
            plain_step(8)
        proposer.propose(Round(seqs, [8, 8], [eagle, eagle], [3, 3]))
        # a backlog is fed and timed apart, left out of the draft's and the step's costs
        assert not proposer.caught_up and (proposer.backlog_seconds > 0) == backlog, steps
