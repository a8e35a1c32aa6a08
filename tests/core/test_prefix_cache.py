"""Automatic prefix caching: output never changes, the budget holds, and it is reported.

The radix tree is checked against a plain model of what was recorded
(hypothesis), and the engine with real models: multi-turn conversations
served with the cache must produce exactly what they produce without it
(greedy and seeded sampling, speculation off and on, draft models and EAGLE
heads, sliding-window and recurrent families), while later turns start from
cached prefixes.  The HTTP side is checked with the official client and the
daemon's own ``/metrics`` and status.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import subprocess
import sys
import time
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, code_sample, run_engine
from specd.core import prefix as prefix_module
from specd.core.cache import kv_bytes
from specd.core.loader import load_model, text_config, vocab_size
from specd.core.prefix import PrefixStore, RowPrefixes
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.engine.resources import ENGINE_OVERHEAD
from specd.forge.families import build

GREEDY = SamplingParams(temperature=0, logprobs=True)  # log-probabilities catch a wrong position or column
NGRAM = SpeculationConfig("ngram", 4, 1, 3)
DRAFT = SpeculationConfig("draft", 3)
EAGLE = SpeculationConfig("eagle", 3)
EAGLE_TREE = SpeculationConfig("eagle", 3, tree_top_k=3, tree_tokens=8)
_ids = itertools.count()


# -- the tree ------------------------------------------------------------------

def column(tokens: list[int], p: int) -> float:
    """What position p holds: like a key, a function of the prefix up to p."""
    return float(sum((t + 1) * 7 ** i for i, t in enumerate(tokens[: p + 1])) % 1009)


def columns_of(tokens: list[int], lo: int, hi: int) -> list[tuple[mx.array, mx.array]]:
    values = mx.array([column(tokens, p) for p in range(lo, hi)]).reshape(1, 1, -1, 1)
    return [(values, -values)]


def prepare(tree, tokens: list[int], length: int) -> None:
    """What ``RowPrefixes.start`` does to the tree for one row, without its lease."""
    tree.cut(tokens, length)
    tree.tidy(tokens, length)


def depth(node) -> int:
    return len(node.key) + depth(node.parent) if node.parent is not None else 0


def attached(node) -> bool:
    while node.parent is not None:
        if node.parent.children.get(int(node.key[0])) is not node:
            return False
        node = node.parent
    return True


sequences = st.lists(st.integers(0, 2), min_size=1, max_size=24)  # a tiny alphabet: prefixes are shared


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(sequences, st.integers(1, 24), st.booleans(), st.integers(0, 12)), min_size=1, max_size=30),
       st.integers(0, 400), st.booleans(), st.sampled_from([2, 5, prefix_module.PIECE_TOKENS]))
def test_the_tree_restores_exactly_what_was_recorded_within_its_budget(rows, budget, stateful, piece_tokens):
    """Rows record prefixes (in two steps, some keeping their lease, the tokens
    after a drawn prompt length as their output, so what is superseded goes when
    a later prefix is prepared); every match restores exactly the recorded columns (and, for a recurrent model,
    only at a snapshot, the snapshot taken there), in the pieces ``ends``
    names, whether or not nodes hold the few positions above them; the budget
    always holds, the byte and node counts are exact, and leased nodes are
    never evicted."""
    with mock.patch.object(prefix_module, "PIECE_TOKENS", piece_tokens):
        check_the_tree(rows, budget, stateful)


def check_the_tree(rows, budget, stateful):
    store = PrefixStore(budget, pressure=None)
    tree = store.tree("t", stateful)
    leases = []
    for tokens, end, keep, prompt in rows:
        end = min(end, len(tokens))
        lease = tree.lease(tokens, 0)
        for stop in sorted({max(1, end // 2), end}):
            snapshot = [[mx.array([column(tokens, stop - 1)])]]
            tree.extend(lease, tokens, stop, lambda lo, hi: columns_of(tokens, lo, hi), snapshot, prompt)
            assert store.bytes <= budget
        (leases if keep else []).append((lease, tokens[: lease.depth]))
        if not keep:
            lease.release()
        for held, prefix in leases:  # a leased path is still in the tree, whole
            assert attached(held.node) and depth(held.node) == len(prefix)
        nodes = tree.nodes()
        assert store.bytes == sum(n.nbytes for n in nodes) and store.nodes == len(nodes)
        for probe, *_ in rows:
            n = tree.match(probe, len(probe))
            if n == 0:
                continue
            prepare(tree, probe, n)  # cuts and merges nodes: the same columns, counts and leases after it
            nodes = tree.nodes()
            assert store.bytes == sum(node.nbytes for node in nodes) and store.nodes == len(nodes)
            for held, prefix in leases:
                assert attached(held.node) and depth(held.node) == len(prefix)
            start = n // 3
            (pieces,), _ = tree.restore(probe, [0], n)
            assert len(pieces) == len(tree.ends(probe, n))
            for got, first in ((pieces, 0), (tree.restore(probe, [start], n)[0][0], start)):
                keys, values = (mx.concatenate(list(sides), axis=2) for sides in zip(*got))
                assert np.array(keys).ravel().tolist() == [column(probe, p) for p in range(first, n)]
                assert np.array(values).ravel().tolist() == [-column(probe, p) for p in range(first, n)]
            if stateful:
                snapshot = tree.restore(probe, [0], n)[1]
                assert snapshot is not None and snapshot[0][0].item() == column(probe, n - 1)


def test_rows_starting_together_each_restore_their_prefix():
    """Short prompts served again together (a benchmark's, a client's retries): until a row
    holds it, a short prompt's cached prefix with its reply below looks like a superseded
    reply (no lease, at most ``SUPERSEDED_PROMPT_TOKENS`` prompt tokens, generated tokens at
    its end), and tidying another row's prefix beside it would drop it before its own row
    restores it (a draft model's rows start in one group, each from its own prefix)."""
    store = PrefixStore(1 << 30, pressure=None)
    tree = store.tree("t", False)
    prompts = [[10 + i for i in range(12)], [50 + i for i in range(12)], [10, 11, 12] + [90 + i for i in range(9)]]
    for prompt in prompts:  # each served once: its prompt, then its reply
        tokens = prompt + [900 + i for i in range(20)]
        lease = tree.lease(tokens, 0)
        tree.extend(lease, tokens, len(tokens) - 1, lambda lo, hi: columns_of(tokens, lo, hi), prompt=len(prompt))
        lease.release()
    rows = RowPrefixes(tree, [None])
    lengths = [rows.match(prompt) for prompt in prompts]
    assert lengths == [11, 11, 11]
    starts = rows.start([(i, prompt, n) for i, (prompt, n) in enumerate(zip(prompts, lengths))])
    for prompt, n, prefix in zip(prompts, lengths, starts):
        keys = mx.concatenate([k for k, _ in prefix.columns[0]], axis=2)
        assert prefix.length == n and np.array(keys).ravel().tolist() == [column(prompt, p) for p in range(n)]
    for i in range(len(prompts)):
        rows.release(i)
    nodes = tree.nodes()
    assert store.bytes == sum(node.nbytes for node in nodes) and store.nodes == len(nodes)
    assert not any(node.locks for node in nodes)


def test_a_row_reads_long_nodes_in_place_and_copies_short_ones():
    """A row reads a cached prefix's leading nodes in place as far as each piece
    saves more than ``PIECE_TOKENS`` tokens of copying (and the budget counts
    them as the prefix cache's), and copies the rest: a short prefix whole, and a
    conversation's turns after a long system prompt, which are short nodes that
    cannot merge (another prompt branches after each),
    so the row reads two pieces, not one per turn; and a long node below a
    few positions (a chat template's opening) holds a copy of them. (Here each
    turn branches because another prompt went on differently, which the tree
    keeps: a reply that was only generated makes way,
    ``test_a_conversations_superseded_replies_make_way_for_its_turns_to_merge``.)"""
    def cached(*prompts):
        tree = PrefixStore(1 << 30, pressure=None).tree("t", False)
        for tokens in prompts:
            lease = tree.lease(tokens, 0)
            tree.extend(lease, tokens, len(tokens), lambda lo, hi: columns_of(tokens, lo, hi) * 2)
            lease.release()
        return RowPrefixes(tree, [None, 8]), RowPrefixes(tree, [None])

    system = list(range(1, 400))
    long, short = prefix_module.PIECE_TOKENS, prefix_module.PIECE_TOKENS - 1
    rows, _ = cached(system)
    assert rows.start([("a", system, long)])[0].in_place == long and rows.shared(system, long) == 7  # the window's last 7
    rows, _ = cached(system)
    assert rows.start([("b", system, short)])[0].in_place == 0 and rows.shared(system, short) == 0
    history, replies = list(system), [system]
    for turn in range(4):
        history = history + [1000 + 100 * turn + i for i in range(30)]
        replies.append(history + [5000 + turn])  # the reply as generated: the next turn diverges before its end
    rows, full = cached(*replies)
    prepare(rows.tree, history, len(history))
    assert rows.tree.ends(history, len(history)) == [399, 429, 459, 489, 519]
    prefix = full.start([("c", history, len(history))])[0]
    assert prefix.in_place == 399 and full.shared(history, len(history)) == 399
    assert rows.shared(history, len(history)) == 0  # the window's layer sees only copied positions
    assert [sum(k.shape[2] for k, _ in pieces) for pieces in prefix.columns] == [519]
    # prompts that part after their first three tokens: the long node holds those three as well
    other = system[:3] + [9000 + i for i in range(300)]
    rows, _ = cached(system, other)
    prefix = rows.start([("d", other, len(other))])[0]
    assert rows.tree.ends(other, len(other)) == [303] and prefix.in_place == 303
    assert [len(pieces) for pieces in prefix.columns] == [1, 1]
    for pieces, first in zip(prefix.columns, (0, 303 - 7)):
        assert np.array(pieces[0][0]).ravel().tolist() == [column(other, p) for p in range(first, 303)]


def test_a_conversations_superseded_replies_make_way_for_its_turns_to_merge():
    """Each reply as generated, and the few prompt tokens before it that the next turn
    renders otherwise (a chat template's "assistant" line, then the reply resent as
    text), go once the next turn restores its prefix: the conversation's turns merge
    into one node that a row reads in one piece, however many turns it has. A reply a
    request still holds stays, and so does a branch with more than
    ``SUPERSEDED_PROMPT_TOKENS`` prompt tokens of its own (another conversation on the
    same system prompt)."""
    store = PrefixStore(1 << 30, pressure=None)
    tree = store.tree("t", False)

    def request(prompt: list[int], reply: list[int]):
        """A request as the scheduler records it: its prompt but the last token as it
        prefills, then all it held as it leaves; returns its lease."""
        n = tree.match(prompt, len(prompt) - 1)
        prepare(tree, prompt, n)
        lease = tree.lease(prompt, n)
        tokens = prompt + reply
        for end in (len(prompt) - 1, len(tokens) - 1):
            tree.extend(lease, tokens, end, lambda lo, hi: columns_of(tokens, lo, hi), prompt=len(prompt))
        return lease

    system = list(range(1, 400))
    other = system + [7000 + i for i in range(prefix_module.SUPERSEDED_PROMPT_TOKENS + 1)]  # one too many to go
    request(other, [8000, 8001]).release()
    history, held = list(system), None
    for turn in range(6):
        prompt = history + [1000 + 100 * turn + i for i in range(30)] + [1, 2]  # ends with "assistant\n"
        reply = [5000 + 100 * turn + i for i in range(20)]
        lease = request(prompt, reply)
        if turn == 3:
            held = lease, prompt + reply[:-1]
        else:
            lease.release()
        history = prompt[:-1] + [3] + reply[:10] + [4]  # the next turn renders it otherwise from its last token on
    cached = tree.match(history, len(history))
    assert cached == len(history) - 12  # all but the last reply, as resent
    prepare(tree, history, cached)
    assert tree.match(other, len(other)) == len(other)
    lease, reply = held
    assert attached(lease.node) and depth(lease.node) == len(reply)
    pieces = tree.ends(history, cached)
    assert pieces[0] == len(system) and len(pieces) == 3  # turns 1-4, then 5 and 6: the held reply parts them
    lease.release()
    prepare(tree, history, cached)
    assert tree.ends(history, cached) == [len(system), cached]
    nodes = tree.nodes()
    # the system prompt, the other conversation and its reply, this one and its last reply
    assert store.nodes == len(nodes) == 5 and store.bytes == sum(n.nbytes for n in nodes)
    (got,), _ = tree.restore(history, [0], cached)
    keys = mx.concatenate([k for k, _ in got], axis=2)
    assert np.array(keys).ravel().tolist() == [column(history, p) for p in range(cached)]


# -- the engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(forged, tmp_path_factory):
    """Loaded models by name: the forged pair, and tiny sliding-window and recurrent families."""
    root = tmp_path_factory.mktemp("prefix-families")
    loaded = {}

    def get(name: str):
        if name not in loaded:
            path = forged / name if name in ("target", "draft") else build(name, root / name, forged / "target")
            loaded[name] = load_model(str(path))
        return loaded[name]
    return get


def eagle_head(model):
    from specd.speculation.eagle.head import EagleConfig, EagleHead

    hidden = text_config(model)["hidden_size"]
    mx.random.seed(0)
    head = EagleHead(EagleConfig(1, hidden, 2 * hidden, 4, 2, vocab_size(model)))
    mx.eval(head.parameters())
    return head


def conversation_prompts(tokenizer):
    ids = tokenizer.encode(code_sample("speculation"))
    return ids[:60], [ids[100 + 7 * t: 105 + 7 * t] for t in range(3)], ids


async def converse(engine, system, questions, opening, spec, params, delay, max_tokens=12):
    """Turns of one conversation, each resending the history with the reply
    but its last two tokens (as a chat template renders a resent reply with
    other tokens: the reply as generated is superseded); per turn (tokens,
    cached tokens, log-probabilities of the tokens)."""
    await asyncio.sleep(delay)
    history, turns = list(system) + opening, []
    for t, question in enumerate(questions):
        prompt = history + question
        seed_params = params if params.greedy else SamplingParams(temperature=params.temperature, seed=1000 + t,
                                                                   logprobs=True)
        request = GenerationRequest(f"p{next(_ids)}", prompt, seed_params, max_tokens, (), spec)
        tokens, cached, logprobs = [], None, []
        async for out in engine.generate(request):
            assert out.error is None, out.error
            tokens += out.tokens
            logprobs += [lp.logprob for lp in out.logprobs or []]
            cached = out.cached_tokens
        turns.append((tokens, cached, logprobs))
        history = prompt + tokens[:max(1, len(tokens) - 2)]
    return turns


def play(model, tokenizer, budget, spec=None, drafter=None, params=GREEDY, conversations=3,
         piece_tokens=prefix_module.PIECE_TOKENS, **config):
    """Conversations in one engine, after a request that shares only their
    first token (a chat template's opening: their prefixes start below a node
    of one token), arriving a little apart (rows of different conversations
    and turns share batches, some starting from cached prefixes and some not);
    returns their turns, whether some batch mixed rows that did and did not
    start from the cache, and the prefix store's status (taken before the
    engine stops and clears it) with the draft tree's bytes. A small
    ``piece_tokens`` makes rows read these short prefixes in place, in part."""
    system, questions, ids = conversation_prompts(tokenizer)
    specs = spec if isinstance(spec, list) else [spec] * conversations

    async def go(engine):
        opening = GenerationRequest(f"p{next(_ids)}", system[:1] + ids[700:740], GREEDY, 2, (), specs[0])
        assert all([out.error is None async for out in engine.generate(opening)])
        mixed = False

        async def watch():
            nonlocal mixed
            while True:
                cached = {s.cached_tokens > 1 for s in list(engine.scheduler.batch.seqs)}  # beyond the opening's
                mixed = mixed or cached == {True, False}
                await asyncio.sleep(0.002)
        watcher = asyncio.ensure_future(watch())
        turns = await asyncio.gather(*(converse(engine, system, questions, ids[500 + 3 * i: 503 + 3 * i],
                                                specs[i], params, 0.01 * i) for i in range(conversations)))
        watcher.cancel()
        store = engine.scheduler.prefix_store
        drafter = store.trees.get("drafter")
        drafter_bytes = sum(n.nbytes for n in drafter.nodes()) if drafter else 0
        return turns, mixed, {**store.status(), "drafterBytes": drafter_bytes}
    settings = {"max_batch_size": 4, "prefill_step_tokens": 16, **config}
    with mock.patch.object(prefix_module, "PIECE_TOKENS", piece_tokens):
        return run_engine(model, tokenizer, go, drafter, prefix_cache_bytes=budget, **settings)


def tokens_of(turns):
    return [[turn[0] for turn in conv] for conv in turns]


def assert_same(turns, expected) -> None:
    """The same tokens, with the same log-probabilities (to float rounding)."""
    assert tokens_of(turns) == tokens_of(expected)
    got = np.array([lp for conv in turns for turn in conv for lp in turn[2]])
    want = np.array([lp for conv in expected for turn in conv for lp in turn[2]])
    assert len(got) == len(want) and np.allclose(got, want, atol=1e-4), np.abs(got - want).max()


@pytest.mark.parametrize("family", ["target", "gemma3_text", "qwen3_next", "falcon_h1"])
def test_conversations_are_identical_with_and_without_the_cache(family, models):
    """Greedy, speculation off, n-gram and a mixed batch: the forged Llama,
    a sliding-window family and two recurrent ones (state snapshots); rows
    copy their short prefixes, or read them in place in part."""
    model, tokenizer = models(family)
    expected, _, _ = play(model, tokenizer, 0)
    for spec, piece_tokens in ((None, 16), (NGRAM, prefix_module.PIECE_TOKENS), ([NGRAM, None, NGRAM], 16)):
        for _ in range(3):  # which rows share a batch is up to the machine's timing: until some batch mixed
            turns, mixed, store = play(model, tokenizer, None, spec, piece_tokens=piece_tokens)
            assert_same(turns, expected)
            assert all(cached > 0 for conv in turns for _, cached, _ in conv[1:]), "later turns start from the cache"
            assert store["hitTokens"] > 0 and store["bytes"] > 0
            if mixed:
                break
        assert mixed, "no batch mixed rows that started from the cache with rows that did not, in three tries"


@pytest.mark.parametrize("method", ["draft", "eagle", "eagle-tree"])
def test_draft_models_and_eagle_heads_keep_their_own_cached_prefixes(method, models):
    """The draft model's and the EAGLE head's caches start from their own
    cached prefixes; output is unchanged and every EAGLE row still drafts."""
    from specd.speculation.eagle.proposer import EagleProposer

    model, tokenizer = models("target")
    drafter = models("draft")[0] if method == "draft" else eagle_head(model)
    spec = {"draft": DRAFT, "eagle": EAGLE, "eagle-tree": EAGLE_TREE}[method]
    expected, _, _ = play(model, tokenizer, 0)
    drafting = []
    if method != "draft":
        original = EagleProposer.prefilled

        def prefilled(self, seqs, specs, columns, started):
            original(self, seqs, specs, columns, started)
            if started:
                drafting.extend((s.cached_tokens, s in self.queued) for s in seqs)
        EagleProposer.prefilled = prefilled
    try:
        turns, _, store = play(model, tokenizer, None, spec, drafter, piece_tokens=16)
    finally:
        if method != "draft":
            EagleProposer.prefilled = original
    assert_same(turns, expected)
    assert all(cached > 0 for conv in turns for _, cached, _ in conv[1:])
    assert store["drafterBytes"] > 0
    if drafting:
        assert all(queued for _, queued in drafting) and any(cached for cached, _ in drafting)


def test_seeded_sampling_is_identical_with_and_without_the_cache(models):
    model, tokenizer = models("target")
    params = SamplingParams(temperature=0.9)
    for spec in (None, NGRAM):
        expected, _, _ = play(model, tokenizer, 0, spec, params=params)
        turns, _, _ = play(model, tokenizer, None, spec, params=params)
        assert_same(turns, expected)


def test_a_small_budget_holds_and_output_stays_identical(models):
    """A budget of a few turns' worth: LRU eviction runs all along, the
    budget holds at every step, and nothing changes in the output."""
    model, tokenizer = models("target")
    expected, _, _ = play(model, tokenizer, 0)
    budget = 150_000
    turns, _, store = play(model, tokenizer, budget, NGRAM)
    assert_same(turns, expected)
    assert store["evictedNodes"] > 0 and store["bytes"] <= budget


def test_a_stopped_engine_frees_its_cache_without_a_garbage_collection(models):
    """A Model edit restarts its engine; the old cache (a tenth of memory by
    default) must go with it at once, not at Python's next full collection
    (parent and child nodes refer to each other, which stopping unlinks)."""
    model, tokenizer = models("target")
    play(model, tokenizer, None, NGRAM)  # what the first run builds lazily stays
    gc.collect()
    base = mx.get_active_memory()
    gc.disable()
    try:
        _, _, store = play(model, tokenizer, None, NGRAM)
        left = mx.get_active_memory() - base
    finally:
        gc.enable()
    assert store["bytes"] > 0 and left < store["bytes"] / 10, (left, store["bytes"])


def test_requests_sharing_a_prefix_that_is_still_being_prefilled(models):
    """Requests that share a long prompt prefix with one still prefilling (or
    arriving with it) wait for it and start from it, with the same output."""
    model, tokenizer = models("target")
    ids = tokenizer.encode(code_sample("engine"))
    shared = ids[:150]
    prompts = [shared + ids[200 + 5 * i: 204 + 5 * i] for i in range(4)]

    def serve(budget):
        async def go(engine):
            async def one(prompt, delay):
                await asyncio.sleep(delay)
                tokens, cached = [], 0
                async for out in engine.generate(GenerationRequest(f"s{next(_ids)}", prompt, GREEDY, 10)):
                    tokens += out.tokens
                    cached = out.cached_tokens
                return tokens, cached
            # two arrive together, two while the first group is prefilling (16 tokens a step)
            return await asyncio.gather(*(one(p, d) for p, d in zip(prompts, (0, 0, 0.02, 0.04))))
        return run_engine(model, tokenizer, go, max_batch_size=4, prefill_step_tokens=16, prefix_cache_bytes=budget)
    expected = serve(0)
    got = serve(None)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert got[0][1] == 0 and all(cached >= len(shared) for _, cached in got[1:]), [c for _, c in got]


def test_requests_on_one_system_prompt_hold_it_once(models):
    """Six requests on one cached 640-token system prompt, under a KV budget
    that holds two rows of that prompt: each row reads the prompt in place
    from the prefix cache and holds only its own tokens, so the six decode
    together, none is preempted, the rows hold less than one prompt's worth
    beside each other, and every request's tokens (greedy, n-gram rollback in
    some rows) equal a run without the prefix cache."""
    model, tokenizer = models("target")
    ids = tokenizer.encode(code_sample("speculation"))
    system = ids[:640]
    prompts = [system + ids[700 + 20 * i: 712 + 20 * i] for i in range(6)]
    specs = [None, NGRAM] * 3
    token_bytes = kv_bytes(model)[0]
    budget = 2 * token_bytes * -(-(len(prompts[0]) + 64 + 64) // 64) * 64

    def serve(prefix_cache, kv_budget):
        async def go(engine):
            async def one(prompt, spec):
                request = GenerationRequest(f"s{next(_ids)}", prompt, GREEDY, 64, (), spec)
                return [t async for out in engine.generate(request) for t in out.tokens]
            rows = held = shared = 0

            async def watch():
                nonlocal rows, held, shared
                while True:
                    running = len(engine.scheduler.batch.seqs)
                    rows = max(rows, running)
                    if running > 1:
                        held = max(held, engine.scheduler.kv.held_bytes)
                        shared = max(shared, engine.kv_cache_status()["sharedTokens"])
                    await asyncio.sleep(0.002)
            await one(system + ids[680:684], None)  # the system prompt, cached
            watcher = asyncio.ensure_future(watch())
            outs = await asyncio.gather(*(one(p, s) for p, s in zip(prompts, specs)))
            watcher.cancel()
            return outs, rows, held, shared, engine.kv_cache_status()
        return run_engine(model, tokenizer, go, max_batch_size=8, prefix_cache_bytes=prefix_cache,
                          kv_cache_bytes=kv_budget)
    expected, _, _, _, _ = serve(0, None)
    got, rows, held, shared, status = serve(None, budget)
    assert got == expected
    assert rows == 6 and status["preemptions"] == 0, (rows, status)
    assert 0 < held < len(system) * token_bytes, (held, len(system) * token_bytes)
    assert shared >= 5 * len(system), shared  # what describe model and /metrics report


def test_the_cache_gives_way_under_memory_pressure(models):
    """Once MLX is short of memory under its limit (``MemoryGuard.short``), the cache drops
    what it holds and records nothing new, and requests are served as before: the limit still
    has room for their KV and a step's working memory."""
    model, tokenizer = models("target")
    system, questions, ids = conversation_prompts(tokenizer)
    expected, _, _ = play(model, tokenizer, 0, conversations=2)

    async def go(engine):
        store = engine.scheduler.prefix_store
        first = await converse(engine, system, questions, ids[500:503], None, GREEDY, 0)
        held = store.bytes
        # room for less than two steps' working memory, whatever the cache gives back
        limit = mx.set_memory_limit(mx.get_active_memory() + ENGINE_OVERHEAD + (8 << 20))
        try:
            second = await converse(engine, system, questions, ids[503:506], None, GREEDY, 0)
        finally:
            mx.set_memory_limit(limit)
        return [first, second], held, store.bytes
    turns, held, after = run_engine(model, tokenizer, go, max_batch_size=4, prefill_step_tokens=16)
    assert_same(turns, expected)
    assert held > 0 and after == 0


# -- over HTTP ---------------------------------------------------------------------

def test_cached_tokens_metrics_and_status_over_http(daemon, client, tokenizer):
    """The second turn of a chat reports cached prompt tokens in its usage;
    /metrics has vLLM's prefix-cache series and the KV budget's; describe
    shows the hit rate and the KV budget."""
    system = code_sample("speculation")[:2000]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does this do?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > len(tokenizer.encode(system)) and cached < second.usage.prompt_tokens
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1

    samples = {(s.name, s.labels.get("model_name")): s.value
               for family in text_string_to_metric_families(daemon.get("/metrics")[1].decode())
               for s in family.samples}
    assert samples[("specd_prefix_cache_hits_total", "tiny")] >= cached
    assert samples[("specd_prefix_cache_queries_total", "tiny")] > samples[("specd_prefix_cache_hits_total", "tiny")]
    assert samples[("specd_prefix_cache_bytes", "tiny")] > 0 and samples[("specd_prefix_cache_max_bytes", "tiny")] > 0
    assert samples[("specd_kv_cache_max_bytes", "tiny")] > 0 and ("specd_kv_cache_bytes", "tiny") in samples
    assert ("specd_kv_cache_shared_tokens", "tiny") in samples
    assert ("specd_kv_preemptions_total", "tiny") in samples

    deadline = time.monotonic() + 30  # status is written on the reconciler's next pass
    while True:
        status = json.loads(daemon.get("/apis/specd.dev/v1alpha1/models/tiny")[1])["status"]["prefixCache"]
        if status["hitRate"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["hitRate"] > 0 and 0 < status["bytes"] <= status["maxBytes"]
    kv = json.loads(daemon.get("/apis/specd.dev/v1alpha1/models/tiny")[1])["status"]["kvCache"]
    assert kv["maxBytes"] > 0 and 0 < kv["peakBytes"] <= kv["maxBytes"] and kv["tokenBytes"] > 0, kv
    described = subprocess.run([sys.executable, "-m", "specd.cli", "describe", "model", "tiny",
                                "--server", daemon.url], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "prefixCache:" in described.stdout and "hitRate:" in described.stdout, described.stdout
    assert "kvCache:" in described.stdout and "preemptions:" in described.stdout, described.stdout


@pytest.mark.parametrize("step,alone,together", [(512, 512, True), (4, 4, False), (4, 512, True)])
def test_cached_prompts_resent_together_start_in_one_group_when_their_prefill_fits_one_chunk(forged, step, alone,
                                                                                             together):
    """Clients that resend cached prompts at once (a benchmark's runs, an agent's parallel calls)
    start in one prefill group when the group's prefill fits one chunk, so every first token comes
    in the first step; when it does not, each row starting from a cached prefix waits for a group
    of its own (its prefill attends to its whole context). Either way the tokens are the same. With
    no row decoding, the chunk is the larger one a prefill runs alone (``prefill_alone_tokens``)."""
    from specd.engine.scheduler import EngineConfig, Scheduler, StepInputs
    from specd.metrics import Metrics
    from specd.core.request import NO_SPECULATION
    model, tokenizer = load_model(str(forged / "target"))
    ids = tokenizer.encode(code_sample("engine"))
    prompts = [ids[i * 30: i * 30 + 40 + 3 * i] for i in range(4)]
    chunks = dict(prefill_step_tokens=step, prefill_alone_tokens=alone)
    scheduler = Scheduler("t", model, tokenizer, EngineConfig(**chunks), Metrics(), NO_SPECULATION, None)

    def serve(tag: str, prompts: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        """Every prompt at once: the tokens, how many rows had a token after the first step, and
        each row's cached prompt tokens."""
        seqs = [scheduler.sequence(GenerationRequest(f"{tag}{i}", p, GREEDY, 12), lambda out: None)
                for i, p in enumerate(prompts)]
        scheduler.step(StepInputs(arrivals=seqs))
        started = sum(1 for s in seqs if s.tokens)
        while scheduler.busy:
            scheduler.step(StepInputs())
        return [s.tokens for s in seqs], started, [s.cached_tokens for s in seqs]
    serve("cold", prompts)
    turns = [p + ids[400 + 5 * i: 405 + 5 * i] for i, p in enumerate(prompts)]  # each a next turn of 5 tokens
    fresh = Scheduler("t", model, tokenizer, EngineConfig(**chunks, prefix_cache_bytes=0), Metrics(),
                      NO_SPECULATION, None)
    uncached = []
    for i, turn in enumerate(turns):  # each alone, without a prefix cache
        seq = fresh.sequence(GenerationRequest(f"alone{i}", turn, GREEDY, 12), lambda out: None)
        fresh.step(StepInputs(arrivals=[seq]))
        while fresh.busy:
            fresh.step(StepInputs())
        uncached.append(seq.tokens)
    tokens, started, cached = serve("warm", turns)
    assert tokens == uncached
    assert all(n >= len(p) - 1 for n, p in zip(cached, prompts)), cached
    assert started == (4 if together else 1)
