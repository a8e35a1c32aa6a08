"""The prefix cache's disk tier: what one engine cached is read back by the next, output never
changes, and nothing but a block of this checkpoint, KV layout and format is ever loaded.

Engines here are in process, on real models: the forged Llama (plain and with 8-bit KV), a
sliding-window family and a hybrid recurrent one (which resumes only at a block's end where its
state was kept). The daemon's side (restarts, scale-to-zero, rollout restart, a full disk) is in
``tests/control/test_prefix_disk_daemon.py``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import struct
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import code_sample, run_engine
from specd.core import prefix_disk
from specd.core.loader import load_model
from specd.core.prefix_disk import (Block, BlockError, DiskConfig, DiskTier, checkpoint_identity, decode,
                                    namespace)
from specd.core.request import GenerationRequest
from specd.core.sampling import SamplingParams
from specd.forge.families import build

GREEDY = SamplingParams(temperature=0, logprobs=True)
PROMPT_TOKENS = 900  # three whole blocks and a part
_ids = itertools.count()


@pytest.fixture(scope="module")
def models(forged, tmp_path_factory):
    root = tmp_path_factory.mktemp("disk-families")
    loaded = {}

    def get(name: str):
        if name not in loaded:
            if name == "target":
                path = forged / "target"
            elif name == "llama-wide":  # heads MLX can quantize in groups of 64
                path = build("llama", root / name, forged / "target", overrides={"head_dim": 64})
            else:
                path = build(name, root / name, forged / "target")
            loaded[name] = (*load_model(str(path)), path)
        return loaded[name]
    return get


def prompt(tokenizer) -> list[int]:
    ids = tokenizer.encode(code_sample("speculation"))
    return (ids * (PROMPT_TOKENS // len(ids) + 1))[:PROMPT_TOKENS]


async def ask(engine, tokens: list[int]) -> tuple[list[int], int, list[float]]:
    out_tokens, cached, logprobs = [], None, []
    async for out in engine.generate(GenerationRequest(f"d{next(_ids)}", tokens, GREEDY, 10, ())):
        assert out.error is None, out.error
        out_tokens += out.tokens
        cached = out.cached_tokens
        logprobs += [lp.logprob for lp in out.logprobs or []]
    return out_tokens, cached, logprobs


def serve(loaded, tokens: list[int], **config) -> tuple[tuple[list[int], int, list[float]], dict]:
    """One request in a fresh engine; its answer and the prefix cache's status (before the engine stops)."""
    model, tokenizer, _ = loaded

    async def go(engine):
        answer = await ask(engine, tokens)
        return answer, engine.prefix_cache_status()
    return run_engine(model, tokenizer, go, **config)


def disk(tmp_path: Path, loaded, max_bytes: int = 10**9, identity: str | None = None) -> DiskConfig:
    return DiskConfig(tmp_path / "blocks", max_bytes, identity or checkpoint_identity(loaded[2]))


def assert_same(got, want) -> None:
    assert got[0] == want[0]
    assert np.allclose(got[2], want[2], atol=1e-4)


def block_files(config: DiskConfig) -> list[Path]:
    return sorted(p for p in config.directory.rglob("*") if p.suffix in (".blk", ".sblk"))


@pytest.mark.parametrize("family,kv_bits", [("target", None), ("llama-wide", 8), ("gemma3_text", None),
                                             ("qwen3_next", None)])
def test_a_prefix_one_engine_cached_is_read_from_disk_by_the_next(family, kv_bits, models, tmp_path):
    """The next engine (a restart, a reload, scale-to-zero) starts from the blocks on disk, and
    answers exactly as an engine without any cache. A hybrid model resumes at the last block that
    ends where a prefill chunk kept its recurrent state."""
    loaded = models(family)
    tokens = prompt(loaded[1])
    follow = tokens + [11, 12, 13]
    cold, _ = serve(loaded, follow, prefix_cache_bytes=0, kv_bits=kv_bits)
    config = disk(tmp_path, loaded)
    first, status = serve(loaded, tokens, prefix_disk=config, kv_bits=kv_bits)
    assert first[1] == 0 and status["disk"]["available"]
    assert len(block_files(config)) == 3, "every whole block is written as the engine stops at the latest"
    answer, status = serve(loaded, follow, prefix_disk=config, kv_bits=kv_bits)
    stateful = family == "qwen3_next"
    assert answer[1] == (512 if stateful else 768), "restored in whole blocks (a hybrid: to its last state)"
    assert_same(answer, cold)
    assert status["disk"]["hitTokens"] == answer[1] and status["disk"]["readBytes"] > 0
    assert status["hitTokens"] == answer[1], "the blocks read went into the RAM tree"


def test_blocks_of_other_kv_bits_or_another_checkpoint_are_never_read(models, tmp_path):
    loaded = models("llama-wide")
    tokens = prompt(loaded[1])
    config = disk(tmp_path, loaded)
    serve(loaded, tokens, prefix_disk=config)
    for other, kv_bits in ((config, 8), (disk(tmp_path, loaded, identity="another revision"), None)):
        answer, status = serve(loaded, tokens + [1], prefix_disk=other, kv_bits=kv_bits)
        assert answer[1] == 0 and status["disk"]["readBytes"] == 0 and status["disk"]["hitTokens"] == 0


def damage(path: Path, kind: str) -> None:
    data = bytearray(path.read_bytes())
    if kind == "corrupt":
        data[len(data) // 2] ^= 0x40
    elif kind == "truncated":
        data = data[: len(data) // 3]
    else:  # a block from a future specd: another format version, its checksum right for it
        magic, _, length = struct.unpack_from("<8sII", data)
        data[:16] = struct.pack("<8sII", magic, prefix_disk.FORMAT + 1, length)
        data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    path.write_bytes(bytes(data))


def header(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[16:16 + struct.unpack_from("<8sII", data)[2]])


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "foreign"])
def test_a_damaged_block_is_skipped_and_deleted_never_loaded(kind, models, tmp_path):
    """The prompt's second block damaged: the restore stops before it (the first block is read),
    the file is deleted and counted, and the answer is what an engine without a cache gives."""
    loaded = models("target")
    tokens = prompt(loaded[1])
    cold, _ = serve(loaded, tokens + [7], prefix_cache_bytes=0)
    config = disk(tmp_path, loaded)
    serve(loaded, tokens, prefix_disk=config)
    victim = next(f for f in block_files(config) if header(f)["tokens"] == tokens[256:512])
    damage(victim, kind)
    answer, status = serve(loaded, tokens + [7], prefix_disk=config)
    assert_same(answer, cold)
    assert answer[1] == 256
    assert status["disk"]["refusedBlocks"] == {kind: 1}
    data = victim.read_bytes()  # deleted, then written again from what this engine prefilled
    assert hashlib.sha256(data[:-32]).digest() == data[-32:] and header(victim)["tokens"] == tokens[256:512]


def synthetic(tier: DiskTier, j: int, columns: int = 256) -> Block:
    keys = mx.full((1, 2, columns, 8), float(j))
    block = Block.of(f"{j:064x}", np.arange(columns), [[(keys, -keys)]], None)
    mx.eval(block.arrays())
    return block


def block_size(directory: Path) -> int:
    """The bytes of one synthetic block's file (written in ``directory``, left there)."""
    tier = DiskTier(DiskConfig(directory, 10**9, "synthetic"), namespace("synthetic", None, "target"), stateful=False)
    tier.save(synthetic(tier, 0))
    tier.flush()
    tier.close()
    return tier.bytes


def test_the_directory_stays_within_max_bytes_least_recently_used_first(tmp_path):
    size = block_size(tmp_path / "blocks")
    config = DiskConfig(tmp_path / "blocks", 4 * size + size // 2, "synthetic")
    tier = DiskTier(config, namespace("synthetic", None, "target"), stateful=False)
    for j in range(1, 5):
        tier.save(synthetic(tier, j))
        tier.flush()
        time.sleep(0.01)  # distinct modification times: the order survives a restart
    assert tier.counters.evicted_blocks == 1 and tier.bytes <= config.max_bytes
    # a hit makes block 1 the most recently used: block 2 goes next
    tier._touch(tier._index[f"{1:064x}"])
    tier.save(synthetic(tier, 5))
    tier.flush()
    tier.close()
    kept = {p.name.split(".")[0] for p in block_files(config)}
    assert kept == {f"{j:064x}" for j in (1, 3, 4, 5)}
    again = DiskTier(config, namespace("synthetic", None, "target"), stateful=False)
    assert again.bytes == 4 * size and again.bytes <= config.max_bytes and len(again._index) == 4
    again.close()


def test_two_tiers_on_one_directory_stay_within_max_bytes_together(tmp_path):
    """An engine reloaded beside the one it replaces: both write to the Model's directory, whose
    files never pass maxBytes, not even for a moment (room is made before each write)."""
    size = block_size(tmp_path / "probe")
    config = DiskConfig(tmp_path / "blocks", 3 * size + size // 2, "synthetic")
    old = DiskTier(config, namespace("synthetic", None, "target"), stateful=False)
    new = DiskTier(config, namespace("synthetic", None, "target"), stateful=False)
    largest = 0
    for j in range(12):
        tier = (old, new)[j % 2]
        tier.save(synthetic(tier, j))
        tier.flush()
        largest = max(largest, sum(p.stat().st_size for p in config.directory.rglob("*") if p.is_file()))
    assert largest <= config.max_bytes and old.bytes == new.bytes <= config.max_bytes
    old.close()
    new.close()


def test_a_directory_that_refuses_writes_leaves_the_engine_serving(models, tmp_path):
    loaded = models("target")
    tokens = prompt(loaded[1])
    cold, _ = serve(loaded, tokens, prefix_cache_bytes=0)
    (tmp_path / "a-file").write_text("not a directory")
    config = DiskConfig(tmp_path / "a-file" / "blocks", 10**9, checkpoint_identity(loaded[2]))
    answer, status = serve(loaded, tokens, prefix_disk=config)
    assert_same(answer, cold)
    assert not status["disk"]["available"] and "NotADirectoryError" in status["disk"]["error"]


@functools.cache
def fuzzed_block() -> tuple[str, Block, bytes]:
    """One small block's file, written by a real tier."""
    root = Path(tempfile.mkdtemp())
    space = namespace("fuzz", None, "target")
    tier = DiskTier(DiskConfig(root, 10**9, "fuzz"), space, stateful=False)
    block = synthetic(tier, 3, columns=4)
    tier.save(block)
    tier.close()
    return space, block, block_files(DiskConfig(root, 0, ""))[0].read_bytes()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_damage_to_a_block_file_is_refused_or_harmless(data):
    """Bytes flipped, cut or appended anywhere: ``decode`` refuses the file or reads exactly the block."""
    space, block, original = fuzzed_block()
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "cut", "append"]))
        if action == "flip" and damaged:
            i = data.draw(st.integers(0, len(damaged) - 1))
            damaged[i] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            damaged = damaged[: data.draw(st.integers(0, len(damaged)))]
        else:
            damaged += data.draw(st.binary(min_size=1, max_size=64))
    try:
        read = decode(bytes(damaged), space, block.hash, block.tokens)
    except BlockError:
        return
    assert bytes(damaged) == original
    keys, values = read.columns[0]
    assert mx.array_equal(keys, mx.full((1, 2, 4, 8), 3.0)).item() and mx.array_equal(values, -keys).item()


def test_writing_never_waits_for_the_disk(models, tmp_path, monkeypatch):
    """A writer that cannot keep up drops blocks (counted); the engine's answer does not wait for it."""
    loaded = models("target")
    tokens = prompt(loaded[1])
    config = disk(tmp_path, loaded)
    monkeypatch.setattr(prefix_disk, "PENDING_BYTES", 1)
    answer, status = serve(loaded, tokens, prefix_disk=config)
    assert answer[1] == 0 and status["disk"]["droppedBlocks"] == 3 and status["disk"]["writtenBlocks"] == 0
    assert not block_files(config)


def test_the_disk_tier_is_not_in_the_models_memory_request(forged):
    from specd.api.manifest import ModelSpec, PrefixDisk
    from specd.engine.resources import memory_request

    plain = ModelSpec(source=str(forged / "target"))
    with_disk = ModelSpec(source=str(forged / "target"), prefix_cache_disk=PrefixDisk(None, 10**12))
    assert memory_request(with_disk, None, 1 << 34) == memory_request(plain, None, 1 << 34)
