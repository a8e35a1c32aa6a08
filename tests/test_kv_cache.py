"""SpeculativeKVCache: per-row rollback leaves exactly the accepted tokens."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np

from specd.core.cache import KVRowCache, SpeculativeKVCache


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
        KVRowCache([cache]).rollback(rejected)
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
