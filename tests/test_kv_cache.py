"""SpeculativeKVCache: per-row rollback leaves exactly the accepted tokens."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np

from specd.core.cache import BatchRowCache
from specd.core.kv import SpeculativeKVCache


def live_keys(cache: SpeculativeKVCache, row: int) -> np.ndarray:
    """The keys row ``row`` can attend to, in order (what the mask lets through)."""
    mask = np.array(cache.make_mask(1, return_array=True))[row, 0, 0, :-1]
    keys = np.array(cache.keys[row, 0, : cache._idx, 0])
    return keys[mask]


def test_random_rollbacks_match_a_reference_of_kept_tokens():
    rng = random.Random(0)
    lengths = [3, 7, 1]
    cache = SpeculativeKVCache([7 - n for n in lengths])
    counter = iter(range(1, 10**6))
    kept: list[list[float]] = [[] for _ in lengths]

    def write(tokens_per_row: list[list[float]], width: int):
        block = np.zeros((3, 1, width, 1), dtype=np.float32)
        for b, toks in enumerate(tokens_per_row):
            block[b, 0, width - len(toks):, 0] = toks  # prompts are left-padded
        cache.update_and_fetch(mx.array(block), mx.array(block))

    prompts = [[float(next(counter)) for _ in range(n)] for n in lengths]
    write(prompts, 7)
    for b, p in enumerate(prompts):
        kept[b] += p
    for step in range(60):
        width = rng.randint(1, 5)
        new = [[float(next(counter)) for _ in range(width)] for _ in lengths]
        block = np.array(new, dtype=np.float32)[:, None, :, None]
        cache.update_and_fetch(mx.array(block), mx.array(block))
        rejected = [rng.randint(0, width - 1) for _ in lengths]
        BatchRowCache([cache]).rollback(rejected)
        for b, r in enumerate(rejected):
            kept[b] += new[b][: width - r]
        for b in range(3):
            assert live_keys(cache, b).tolist() == kept[b], step
        assert np.array(cache.offset).tolist() == [len(k) for k in kept]
        if step % 17 == 16:
            cache.filter(mx.array([0, 1, 2]))  # compacts: holes become left padding
            assert cache.valid is None
    cache.compact()
    for b in range(3):
        lp = int(np.array(cache.left_padding)[b])
        assert np.array(cache.keys[b, 0, lp: cache._idx, 0]).tolist() == kept[b]


def test_sliding_window_sees_the_last_positions_through_rollbacks_and_evictions():
    """A windowed cache: after any mix of rejected tails (holes) and
    evictions, each new token sees exactly the ``window`` newest kept tokens
    of its row, itself included, and memory stays bounded."""
    rng = random.Random(1)
    window, lengths = 6, [2, 9, 5]
    cache = SpeculativeKVCache([9 - n for n in lengths], window=window)
    rows = BatchRowCache([cache])
    counter = iter(range(1, 10**6))
    kept: list[list[float]] = [[] for _ in lengths]
    prompts = [[float(next(counter)) for _ in range(n)] for n in lengths]
    block = np.zeros((3, 1, 9, 1), dtype=np.float32)
    for b, p in enumerate(prompts):
        block[b, 0, 9 - len(p):, 0] = p
        kept[b] += p
    cache.update_and_fetch(mx.array(block), mx.array(block))
    widest = 0
    for step in range(120):
        if cache.needs_eviction():
            cache.evict()
        width = rng.randint(1, 4)
        mask = np.array(cache.make_mask(width, return_array=True))  # (B, 1, width, _idx + width)
        keys = np.array(cache.keys[:, 0, : cache._idx, 0])
        new = [[float(next(counter)) for _ in range(width)] for _ in lengths]
        for b in range(3):
            for j in range(width):
                seen = keys[b][mask[b, 0, j, : cache._idx]].tolist() + [new[b][i] for i in range(width)
                                                                         if mask[b, 0, j, cache._idx + i]]
                assert seen == (kept[b] + new[b][: j + 1])[-window:], (step, b, j)
        cache.update_and_fetch(mx.array(np.array(new, dtype=np.float32)[:, None, :, None]),
                               mx.array(np.array(new, dtype=np.float32)[:, None, :, None]))
        rejected = [rng.randint(0, width - 1) for _ in lengths]
        rows.rollback(rejected)
        for b, r in enumerate(rejected):
            kept[b] += new[b][: width - r]
        widest = max(widest, cache._idx)
    assert widest <= 2 * window + SpeculativeKVCache.EVICT_SLACK + 4


def test_a_windowed_prefill_group_keeps_the_padding_of_prompts_that_start_in_a_later_chunk():
    """A short prompt prefilled beside a much longer one is all padding for
    the first chunks; evicting between chunks (the long row outgrows the
    window) must keep the short row's padding still to be written, or its
    own tokens would attend to those padding columns."""
    window, chunk, lengths = 4, 5, [40, 3, 12]
    width = max(lengths)
    cache = SpeculativeKVCache([width - n for n in lengths], window=window)
    counter = iter(range(1, 10**6))
    prompts = [[0.0] * (width - n) + [float(next(counter)) for _ in range(n)] for n in lengths]
    evicted = False
    for start in range(0, width, chunk):
        if cache.needs_eviction():
            cache.evict()
            evicted = True
        end = min(width, start + chunk)
        mask = np.array(cache.make_mask(end - start, return_array=True))  # (B, 1, N, _idx + N)
        keys = np.array(cache.keys[:, 0, : cache._idx, 0]) if cache.keys is not None else np.zeros((3, 0))
        block = np.array([p[start:end] for p in prompts], dtype=np.float32)
        for b, n in enumerate(lengths):
            for j in range(end - start):
                position = start + j
                if position < width - n:
                    continue  # a padding query: what it sees is never read
                seen = keys[b][mask[b, 0, j, : cache._idx]].tolist() + [
                    block[b][i] for i in range(end - start) if mask[b, 0, j, cache._idx + i]]
                assert seen == prompts[b][width - n: position + 1][-window:], (start, b, j)
        cache.update_and_fetch(mx.array(block[:, None, :, None]), mx.array(block[:, None, :, None]))
    assert evicted
