"""RowKV: each row holds exactly its kept tokens, and each new token attends to
exactly what it may see, through rollbacks, draft trees, windows, evictions,
padding, joins and leaves.

Keys are all zero, so a query weighs every column it sees alike, and values
are one-hot token ids: ``attend``'s output names the tokens each query sees.
"""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specd.core import attention, layout
from specd.core.attention import SOFTMAX_MIN_SCORES, RowColumns, attend_block, attend_rows, softmax
from specd.core.cache import BatchRowCache
from specd.core.columns import STEP, KVQuantization, parts, side_concat, side_slice, stored
from specd.core.kv import RowKV

D = 1024  # token ids are below this


@pytest.fixture(autouse=True, scope="module", params=["row by row", "gathered", "dealt to streams", "block"])
def attention_path(request):
    """Every test here runs over each of ``RowKV.attend``'s paths, whatever device runs the tests:
    row by row, all rows in one pass (``gathers()`` on a GPU), row by row with every row
    dealt to one of three CPU streams (``deal``, on a CPU of several cores), and the rows' own
    columns laid out as one block wherever that layout may be taken (``layout.LAYOUT``)."""
    chosen, threshold, streams, laid_out = attention.gathers, attention.DEAL_MIN_SCORES, attention.CPU_STREAMS, \
        layout.LAYOUT
    attention.gathers = lambda: request.param == "gathered"
    if request.param == "dealt to streams":
        attention.DEAL_MIN_SCORES, attention.CPU_STREAMS = 0, 3
    layout.LAYOUT = "block" if request.param == "block" else "rows"
    yield request.param
    attention.gathers, attention.DEAL_MIN_SCORES, attention.CPU_STREAMS, layout.LAYOUT = chosen, threshold, streams, \
        laid_out


def onehot(tokens: list[list[int]]) -> tuple[mx.array, mx.array]:
    """Keys and values (B, 1, N, D) for rows of token ids (0: padding)."""
    values = np.zeros((len(tokens), 1, len(tokens[0]), D), dtype=np.float32)
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            values[b, 0, j, t] = 1.0
    return mx.zeros(values.shape), mx.array(values)


def write(cache: RowKV, tokens: list[list[int]]) -> list[list[list[int]]]:
    """Write one forward's columns; returns what each new token of each row sees."""
    keys, values = onehot(tokens)
    cache.update_and_fetch(keys, values)
    out = np.array(cache.attend(mx.zeros(keys.shape), scale=1.0))
    return [[np.flatnonzero(out[b, 0, j] > 1e-6).tolist() for j in range(len(row))] for b, row in enumerate(tokens)]


def held(cache: RowKV, b: int) -> list[int]:
    """The token ids row b holds, in order."""
    first = cache.positions[b] - cache.held[b]
    _, values = cache.columns(b, first, cache.positions[b])
    return np.argmax(np.array(values[0, 0]), axis=-1).tolist()


def test_rollbacks_trees_joins_and_leaves_leave_each_row_exactly_its_kept_tokens():
    rng = random.Random(0)
    counter = iter(range(1, 10**6))
    lengths = [3, 7, 1]
    cache = RowKV([7 - n for n in lengths])
    prompts = [[next(counter) for _ in range(n)] for n in lengths]
    seen = write(cache, [[0] * (7 - len(p)) + p for p in prompts])
    kept = [list(p) for p in prompts]
    for b, p in enumerate(prompts):
        assert seen[b][7 - len(p):] == [sorted(p[: j + 1]) for j in range(len(p))]
    for step in range(80):
        width = rng.randint(1, 5)
        new = [[next(counter) for _ in range(width)] for _ in kept]
        seen = write(cache, new)
        for b in range(len(kept)):
            assert seen[b] == [sorted(kept[b] + new[b][: j + 1]) for j in range(width)], step
        drop = np.array([[rng.random() < 0.4 for _ in range(width)] for _ in kept])
        BatchRowCache([cache]).forget(drop)
        for b in range(len(kept)):
            kept[b] += [t for t, d in zip(new[b], drop[b]) if not d]
            assert held(cache, b) == kept[b], step
        assert np.array(cache.offset).tolist() == [len(k) for k in kept]
        if step % 9 == 8:  # one row leaves, the others reorder; a fresh row joins
            order = rng.sample(range(len(kept)), len(kept) - 1)
            cache.select(order)
            kept = [kept[i] for i in order]
            fresh, prompt = RowKV([0]), [next(counter) for _ in range(rng.randint(1, 4))]
            write(fresh, [prompt])
            cache.extend(fresh)
            kept.append(prompt)
    if cache.block is None:
        assert all(cache.keys[b].shape[2] == -(-cache.held[b] // STEP) * STEP for b in range(len(kept)))
    else:  # a block holds no more than the KV budget charges the rows: each a round's growth
        assert cache.block[0].shape[2] * len(kept) <= sum(-(-(h + STEP) // STEP) * STEP for h in cache.held)


def test_draft_trees_see_the_context_and_their_ancestors_within_the_window():
    """Tree verification: each node sees its row's context and its own ancestors,
    both limited to the window in the node's own position (its depth)."""
    rng = random.Random(2)
    counter = iter(range(1, 10**6))
    window = 5
    cache = RowKV([0], window=window)
    kept = [[next(counter) for _ in range(9)]]
    write(cache, kept)
    for _ in range(20):
        n = rng.randint(1, 6)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        ancestry = np.zeros((1, n, n), dtype=bool)
        for j, p in enumerate(parents):
            if p >= 0:
                ancestry[0, j] = ancestry[0, p]
            ancestry[0, j, j] = True
        new = [next(counter) for _ in range(n)]
        cache.tree = mx.array(ancestry)
        seen = write(cache, [new])[0]
        cache.tree = None
        for j in range(n):
            path = [new[i] for i in range(n) if ancestry[0, j, i]]
            assert seen[j] == sorted((kept[0] + path)[-window:])
        branch = [i for i in range(n) if ancestry[0, n - 1, i]]
        cache.forget(np.array([[i not in branch for i in range(n)]]))
        kept[0] += [new[i] for i in branch]
        assert held(cache, 0) == kept[0][-cache.held[0]:]


def test_sliding_window_sees_the_last_positions_through_rollbacks_and_evictions():
    """A windowed cache: after any mix of rejected tails and evictions, each
    new token sees exactly the ``window`` newest kept tokens of its row,
    itself included, and memory stays bounded."""
    rng = random.Random(1)
    counter = iter(range(1, 10**6))
    window, lengths = 6, [2, 9, 5]
    cache = RowKV([9 - n for n in lengths], window=window)
    prompts = [[next(counter) for _ in range(n)] for n in lengths]
    write(cache, [[0] * (9 - len(p)) + p for p in prompts])
    kept = [list(p) for p in prompts]
    widest = 0
    for step in range(120):
        if cache.needs_eviction():
            cache.evict()
        width = rng.randint(1, 4)
        new = [[next(counter) for _ in range(width)] for _ in lengths]
        seen = write(cache, new)
        for b in range(len(lengths)):
            assert seen[b] == [sorted((kept[b] + new[b][: j + 1])[-window:]) for j in range(width)], (step, b)
        rejected = [rng.randint(0, width - 1) for _ in lengths]
        BatchRowCache([cache]).rollback(rejected)
        for b, r in enumerate(rejected):
            kept[b] += new[b][: width - r]
        widest = max(widest, *cache.held)
    assert widest <= 2 * window + RowKV.EVICT_SLACK + 4


def test_a_prefill_group_stores_no_padding_and_its_rows_see_their_own_window():
    """A short prompt prefilled beside a much longer one is all padding for
    the first chunks: none of it is stored, evictions between chunks keep
    what is still to come, and each real token sees its own row's window."""
    window, chunk, lengths = 4, 5, [40, 3, 12]
    width = max(lengths)
    cache = RowKV([width - n for n in lengths], window=window)
    counter = iter(range(1, 10**6))
    prompts = [[0] * (width - n) + [next(counter) for _ in range(n)] for n in lengths]
    evicted = False
    for start in range(0, width, chunk):
        if cache.needs_eviction():
            cache.evict()
            evicted = True
        end = min(width, start + chunk)
        seen = write(cache, [p[start:end] for p in prompts])
        for b, n in enumerate(lengths):
            for j, position in enumerate(range(start, end)):
                if position >= width - n:
                    assert seen[b][j] == sorted(prompts[b][width - n: position + 1][-window:]), (start, b, j)
    assert evicted
    assert cache.positions == lengths


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=12))
def test_rows_joining_and_leaving_in_any_order_keep_their_own_tokens(events):
    """Hypothesis-generated arrivals (prompt length) and departures (which row):
    every row still holds exactly its own tokens and sees only them."""
    counter = iter(range(1, 10**6))
    cache, kept = None, []
    for length, leave in events:
        prompt = [next(counter) for _ in range(length)]
        fresh = RowKV([0])
        write(fresh, [prompt])
        if cache is None:
            cache = fresh
        else:
            cache.extend(fresh)
        kept.append(prompt)
        if leave < len(kept) and len(kept) > 1:
            rows = [i for i in range(len(kept)) if i != leave]
            cache.select(rows)
            kept = [kept[i] for i in rows]
        new = [[next(counter)] for _ in kept]
        seen = write(cache, new)
        for b in range(len(kept)):
            kept[b] += new[b]
            assert seen[b] == [sorted(kept[b])]
            assert held(cache, b) == kept[b]


@settings(max_examples=30, deadline=None)
@given(st.data(), st.sampled_from([None, 5]), st.sampled_from([None, KVQuantization(8, 64)]))
def test_rows_reading_a_shared_prefix_in_place_see_it_and_never_write_it(data, window, quantization):
    """Rows restored from a cached prefix in pieces (the prefix cache's nodes,
    quantized or not) read them in place, or those before a position and a copy
    of the others: through writes, rejected tails,
    draft-tree writes, evictions and leaves, each new token sees exactly its
    row's kept tokens (within the window), the pieces are never written, and
    a row's bytes are its own columns only."""
    counter = iter(range(1, 10**6))
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    prefix = [next(counter) for _ in range(data.draw(st.integers(2, 40)))]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(prefix) - 1), max_size=3)))
    keys, values = onehot([prefix])
    bounds = [0, *cuts, len(prefix)]
    pieces = [(stored(keys[..., lo:hi, :], quantization), stored(values[..., lo:hi, :], quantization))
              for lo, hi in zip(bounds, bounds[1:])]
    mx.eval(pieces)
    before = [[np.array(a) for a in parts(v)] for _, v in pieces]
    start = 0 if window is None else max(0, len(prefix) - (window - 1))  # what a windowed layer restores
    restored = [(side_slice(k, max(start - lo, 0), hi - lo), side_slice(v, max(start - lo, 0), hi - lo))
                for (k, v), lo, hi in zip(pieces, bounds, bounds[1:]) if hi > start]
    rows = data.draw(st.integers(1, 3))
    cache = RowKV([0] * rows, window=window, quantization=quantization)
    in_place = [data.draw(st.one_of(st.none(), st.integers(0, len(prefix)))) for _ in range(rows)]
    for b in range(rows):
        cache.restore(b, restored, len(prefix), in_place[b])
    kept = [list(prefix) for _ in range(rows)]
    assert cache.held == [len(prefix) - start] * rows
    assert cache.shared_columns == [len(prefix) - start if p is None else max(0, p - start) for p in in_place]
    assert (cache.nbytes == 0) == all(p is None or p == len(prefix) for p in in_place)
    for step in range(data.draw(st.integers(1, 12))):
        if cache.needs_eviction():
            cache.evict()
        width = rng.randint(1, 4)
        new = [[next(counter) for _ in range(width)] for _ in kept]
        tree = width > 1 and rng.random() < 0.3
        if tree:  # a chain: each node's ancestors are the nodes before it
            cache.tree = mx.array(np.tril(np.ones((len(kept), width, width), dtype=bool)))
        seen = write(cache, new)
        cache.tree = None
        for b in range(len(kept)):
            want = [sorted((kept[b] + new[b][: j + 1])[-(window or 10**6):]) for j in range(width)]
            assert seen[b] == want, (step, b)
        drop = np.arange(width)[None, :] >= width - np.array([[rng.randint(0, width - 1)] for _ in kept])
        BatchRowCache([cache]).forget(drop)
        for b in range(len(kept)):
            kept[b] += [t for t, d in zip(new[b], drop[b]) if not d]
        if len(kept) > 1 and rng.random() < 0.3:
            order = rng.sample(range(len(kept)), len(kept) - 1)
            cache.select(order)
            kept = [kept[i] for i in order]
    for (_, v), old in zip(pieces, before):
        assert all(np.array_equal(np.array(a), o) for a, o in zip(parts(v), old))
    own = sum(a.nbytes for b in range(len(kept)) if cache.keys[b] is not None
              for a in parts(cache.keys[b]) + parts(cache.values[b]))
    if cache.block is not None:
        own = sum(a.nbytes for side in cache.block for a in parts(side))
    assert cache.nbytes == own


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 9), st.sampled_from([None, 7]), st.sampled_from([1, 2, 4]),
       st.booleans(), st.sampled_from([None, KVQuantization(8, 64), KVQuantization(4, 32)]),
       st.sampled_from([attention.BLOCK_SCORES, 1, 1000, 4000]), st.data())
def test_in_place_attention_over_pieces_equals_mlx_attention(held, n, window, group, sinks, quantization,
                                                              block_scores, data):
    """``attend_columns`` over a row's columns in any number of pieces, its
    queries in blocks of any size, gives what MLX's SDPA (or mlx-lm's quantized
    attention) gives over the same columns in one buffer: grouped heads, causal
    masks, windows, sinks."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from specd.core.attention import attend_columns, causal_mask
    held = max(held, n)
    kv_heads, dims = 2, 64
    mx.random.seed(data.draw(st.integers(0, 1000)))
    queries = mx.random.normal((1, kv_heads * group, n, dims))
    keys, values = mx.random.normal((1, kv_heads, held, dims)), mx.random.normal((1, kv_heads, held, dims))
    sink = mx.random.normal((kv_heads * group,)) if sinks and quantization is None else None
    cuts = sorted(data.draw(st.sets(st.integers(1, held - 1), max_size=3))) if held > 1 else []
    bounds = [0, *cuts, held]
    pieces = [(stored(keys[..., a:b, :], quantization), stored(values[..., a:b, :], quantization))
              for a, b in zip(bounds, bounds[1:])]
    with mock.patch.object(attention, "BLOCK_SCORES", block_scores):
        got = attend_columns(queries * 0.125, pieces, held, window, quantization, sink)
    mask = causal_mask(n, held, held, window)
    if quantization is None:
        want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask, sinks=sink)
    else:
        whole = side_concat([k for k, _ in pieces]), side_concat([v for _, v in pieces])
        want = quantized_scaled_dot_product_attention(queries, *whole, scale=0.125, mask=mask,
                                                      group_size=quantization.group_size, bits=quantization.bits)
    assert np.allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


def test_a_row_of_padding_only_attends_to_nothing_and_keeps_the_values_width():
    """In a prefill group's first chunks a short prompt is all padding: its rows of
    the output are zeros as wide as the values (latent attention's keys are wider)."""
    cache = RowKV([0, 4])
    keys, values = mx.ones((2, 2, 3, 24)), mx.ones((2, 2, 3, 16))
    cache.update_and_fetch(keys, values)
    out = cache.attend(mx.ones((2, 2, 3, 24)), scale=1.0)
    assert out.shape == (2, 2, 3, 16)
    assert np.array(out[1]).tolist() == np.zeros((2, 3, 16)).tolist()
    assert cache.held == [3, 0] and cache.pending == [0, 1]


def test_attention_softmax_over_large_scores_equals_mlx_softmax():
    """Scores of ``SOFTMAX_MIN_SCORES`` or more take e**x from ``_exp2_parts`` on the CPU
    backend: the weights equal MLX's softmax, masked columns (-inf) included, in float32 and
    for half-precision scores, over scores far apart (a row's peak far above the rest)."""
    mx.random.seed(3)
    scores = mx.random.normal((1, 2, 64, 300)) * 8
    masked = mx.where(mx.random.uniform(shape=scores.shape) < 0.3, -mx.inf, scores)
    spread = scores * 40  # differences past 2**-126's reach: weights that round to nothing
    for s, atol in ((scores, 1e-6), (masked, 1e-6), (spread, 1e-6), (masked.astype(mx.float16), 1e-3)):
        assert s.size >= SOFTMAX_MIN_SCORES
        got, want = softmax(s), mx.softmax(s, axis=-1, precise=True)
        assert got.dtype == s.dtype
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=6), st.integers(1, 5), st.sampled_from([None, 9]),
       st.sampled_from([1, 2, 4]), st.data())
def test_gathered_attention_equals_row_by_row_attention(lengths, n, window, group, data):
    """All rows' queries in one pass, over every row's columns side by side under a mask, give each
    query what attending its own row gives: rows of any length, restored in pieces or not,
    grouped heads, several new tokens, windows."""
    kv_heads, dims = 2, 32
    mx.random.seed(data.draw(st.integers(0, 1000)))
    cache = RowKV([0] * len(lengths), window=window)
    for b, length in enumerate(lengths):
        if data.draw(st.booleans()):  # a cached prefix, read in place in pieces
            keys, values = mx.random.normal((1, kv_heads, length, dims)), mx.random.normal((1, kv_heads, length, dims))
            cut = data.draw(st.integers(0, length))
            cache.restore(b, [(keys[..., a:z, :], values[..., a:z, :]) for a, z in ((0, cut), (cut, length)) if z > a],
                          length)
        else:
            one = RowKV([0], window=window)
            one.update_and_fetch(mx.random.normal((1, kv_heads, length, dims)), mx.random.normal((1, kv_heads, length, dims)))
            for name in RowKV._ROW_FIELDS:
                getattr(cache, name)[b] = getattr(one, name)[0]
    cache.update_and_fetch(mx.random.normal((len(lengths), kv_heads, n, dims)),
                           mx.random.normal((len(lengths), kv_heads, n, dims)))
    queries = mx.random.normal((len(lengths), kv_heads * group, n, dims))
    rows = [RowColumns(0, n, cache._pieces(b), cache.held[b]) for b in range(len(lengths))]
    gathered = attention.attend_gathered(queries * 0.25, rows, window)
    want = attend_rows(queries * 0.25, rows, window)
    assert gathered is not None
    np.testing.assert_allclose(np.array(gathered), np.array(want), atol=2e-5, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 150), min_size=1, max_size=6), st.integers(1, 5), st.sampled_from([None, 9]),
       st.sampled_from([1, 2, 4]), st.booleans(), st.sampled_from([None, KVQuantization(8, 64), KVQuantization(4, 32)]),
       st.data())
def test_block_attention_equals_row_by_row_attention(lengths, n, window, group, sinks, quantization, data):
    """Rows' own columns side by side in one block (each padded to the block's width), attended
    by one batched call under a mask, give each query what attending its own row gives: rows of
    any length, several new tokens, windows, grouped heads, sinks, quantized columns."""
    kv_heads, dims = 2, 64
    lengths = [max(length, n) for length in lengths]
    capacity = max(lengths) + data.draw(st.integers(0, 70))
    mx.random.seed(data.draw(st.integers(0, 1000)))
    keys = [mx.random.normal((1, kv_heads, length, dims)) for length in lengths]
    values = [mx.random.normal((1, kv_heads, length, dims)) for length in lengths]

    def block(sides):
        return stored(mx.concatenate([mx.pad(s, [(0, 0), (0, 0), (0, capacity - s.shape[2]), (0, 0)])
                                      for s in sides]), quantization)
    queries = mx.random.normal((len(lengths), kv_heads * group, n, dims)) * 0.125
    sink = mx.random.normal((kv_heads * group,)) if sinks and quantization is None else None
    rows = [RowColumns(0, n, [(stored(k, quantization), stored(v, quantization))], length)
            for k, v, length in zip(keys, values, lengths)]
    got = attend_block(queries, block(keys), block(values), lengths, window, quantization, sink)
    want = attend_rows(queries, rows, window, quantization, sink)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


def test_the_layout_is_the_one_measured_cheaper(monkeypatch):
    """``auto`` (the default) lays rows out as one block only where the costs measured for the
    layer's attention shape on this device say a block is cheaper, changing layout only for a
    clear saving, and never padding the rows past what the KV budget has room for beside
    them; the costs this device measures are lines with no negative part."""
    monkeypatch.setattr(layout, "LAYOUT", "auto")
    counter = iter(range(1, 10**6))
    measured = layout.measure(layout.AttentionShape(1, 2, D, D, mx.float32, None, False))
    assert min(measured.per_row, measured.per_column, measured.fixed, measured.per_cell) >= 0
    assert measured.rows([64] * 16, 1, None) > 0 and measured.block([64] * 16, 1) > 0

    def batch(costs: layout.LayoutCosts, lengths: list[int], room: int = 0) -> RowKV:
        monkeypatch.setattr(layout, "costs", lambda shape, width: costs)
        cache = RowKV([0])
        cache.room = room
        write(cache, [[next(counter) for _ in range(lengths[0])]])
        for length in lengths[1:]:
            other = RowKV([0])
            write(other, [[next(counter) for _ in range(length)]])
            cache.extend(other)
        write(cache, [[next(counter)] for _ in lengths])
        return cache
    cheap_rows = layout.LayoutCosts(per_row=1e-6, per_column=1e-9, fixed=1e-3, per_cell=1e-9)
    cheap_block = layout.LayoutCosts(per_row=1e-4, per_column=1e-9, fixed=1e-5, per_cell=1e-9)
    assert batch(cheap_rows, [5, 9, 3]).block is None
    assert batch(cheap_block, [5, 9, 3]).block is not None
    # a block holds the short row at the long one's width, 320 columns: 128 more than the budget
    # charges the two rows (128 and 384, a round's growth each), taken only where it has room for them
    assert batch(cheap_block, [5, 300]).block is None
    assert batch(cheap_block, [5, 300], room=127).block is None
    assert batch(cheap_block, [5, 300], room=128).block is not None
    # within the margin, a layout is kept
    near = layout.LayoutCosts(per_row=1e-4, per_column=0.0, fixed=1.9e-4, per_cell=0.0)  # rows 2e-4, block 1.9e-4
    assert not near.prefers_block([10, 10], 1, None, now_block=False) and near.prefers_block([10, 10], 1, None, True)


def test_each_forward_width_takes_the_layout_its_own_costs_favour(monkeypatch):
    """A verify forward's few queries a row weigh the layouts by costs timed at that width: a
    batch that decodes row by row (as one query a row measured cheaper) takes the block for a
    verify forward where that width measured the block cheaper, and goes back for a decode step.
    Each width is timed once, up to ``MEASURED_WIDTHS``; a wider forward scales the widest's
    column terms."""
    monkeypatch.setattr(layout, "LAYOUT", "auto")
    cheap_rows = layout.LayoutCosts(per_row=1e-6, per_column=1e-9, fixed=1e-3, per_cell=1e-9)
    cheap_block = layout.LayoutCosts(per_row=1e-4, per_column=1e-9, fixed=1e-5, per_cell=1e-9, width=3)
    asked = []

    def costs(shape, width):
        asked.append(width)
        return cheap_block if width == 3 else cheap_rows
    monkeypatch.setattr(layout, "costs", costs)
    cache = RowKV([0])
    write(cache, [[1, 2, 3, 4]])
    other = RowKV([0])
    write(other, [[5, 6]])
    cache.extend(other)
    assert write(cache, [[7], [8]]) == [[[1, 2, 3, 4, 7]], [[5, 6, 8]]] and cache.block is None
    assert write(cache, [[9, 10, 11], [12, 13, 14]]) == [[[1, 2, 3, 4, 7, 9], [1, 2, 3, 4, 7, 9, 10],
                                                          [1, 2, 3, 4, 7, 9, 10, 11]],
                                                         [[5, 6, 8, 12], [5, 6, 8, 12, 13], [5, 6, 8, 12, 13, 14]]]
    assert cache.block is not None
    write(cache, [[15], [16]])
    assert cache.block is None and set(asked) == {1, 3}

    monkeypatch.undo()
    measured = []
    monkeypatch.setattr(layout, "_MEASURED", {})
    monkeypatch.setattr(layout, "measure", lambda shape, width: measured.append(width) or cheap_block)
    shape = layout.AttentionShape(1, 2, D, D, mx.float32, None, False)
    for width in (3, 3, 1, layout.MEASURED_WIDTHS, 64):
        layout.costs(shape, width)
    assert measured == [3, 1, layout.MEASURED_WIDTHS]
    # measured at 3 queries a row: a forward of 6 pays twice its column terms, not its fixed part
    assert cheap_block.block([10, 20], 6) == pytest.approx(1e-5 + 1e-9 * 2 * 2 * 20)
    assert cheap_block.rows([10, 20], 3, None) == pytest.approx(2e-4 + 1e-9 * 30)


def test_a_step_that_times_a_layout_is_not_billed_for_it(monkeypatch):
    """The step that first meets a width times both layouts inside it, once: the clock steps
    are timed by (the cost model's and the goodput controller's) leaves that out, on the
    thread that timed them, and runs on as ``time.perf_counter`` elsewhere."""
    now = [100.0]  # perf_counter, as the layout module reads it

    def timing(shape, width):
        now[0] += 5.0  # what timing the layouts took
        return layout.LayoutCosts(0, 0, 0, 0, width)
    monkeypatch.setattr(layout, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(layout, "_TIMING", threading.local())
    monkeypatch.setattr(layout, "_MEASURED", {})
    monkeypatch.setattr(layout, "measure", timing)
    shape = layout.AttentionShape(1, 2, D, D, mx.float32, None, False)
    started = layout.clock()
    layout.costs(shape, 2)
    now[0] += 0.25  # the rest of the step
    layout.costs(shape, 2)  # timed already
    assert now[0] == 105.25 and layout.clock() - started == 0.25
    elsewhere = []

    def other_thread() -> None:
        before = layout.clock()
        now[0] += 1.0
        elsewhere.append(layout.clock() - before)
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert elsewhere == [1.0]


def test_the_causal_mask_cache_keeps_the_most_recent_masks_only():
    """Rows' lengths move on every step, so a daemon meets masks of ever new lengths: the cache
    keeps at most ``MASK_CACHE_ENTRIES`` of them (the least recently used go), however few
    cells they hold, and hands a mask it keeps back as it is."""
    from specd.core.attention import MASK_CACHE_ENTRIES, _CAUSAL_MASKS, causal_mask

    first = causal_mask(3, 10, 64, None)
    for held in range(11, 11 + 2 * MASK_CACHE_ENTRIES):
        causal_mask(3, held, 64 * (held // 64 + 1), None)
        assert causal_mask(3, 10, 64, None) is first  # used every step: never the least recent
    assert len(_CAUSAL_MASKS) == MASK_CACHE_ENTRIES
    last = 10 + 2 * MASK_CACHE_ENTRIES
    assert (3, last, 64 * (last // 64 + 1), None) in _CAUSAL_MASKS
    assert (3, 11, 64, None) not in _CAUSAL_MASKS
    assert np.array_equal(np.array(first), np.arange(64)[None, :] <= np.arange(7, 10)[:, None])


def test_a_drain_forgets_every_array_steps_shared():
    """Masks of each layout and the block layout's write indices all go at a drain
    (``forget_masks``): none stays for the engines after it, or for none."""
    from specd.core import attention, kv

    attention.causal_mask(2, 9, 16, None)
    attention._block_mask((9, 5), 2, 2, None, 9)
    attention._gather_mask((9, 5), 2, 2, None)
    index = kv._write_index((9, 5), 2)
    assert np.array_equal(np.array(index)[:, 0, :, 0], [[9, 10], [5, 6]])
    assert all(attention._STEP_ARRAYS) and any(memo is kv._WRITE_INDICES for memo in attention._STEP_ARRAYS)
    attention.forget_masks()
    assert not any(attention._STEP_ARRAYS)
