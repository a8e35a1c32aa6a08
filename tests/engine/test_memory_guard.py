"""MLX's own memory limit set tight (``mx.set_memory_limit``, as ``--mlx-memory-limit`` sets it):
an engine starts a request only with room under it for the request's KV and a step's working
memory; without room it waits while rows run, or is refused with the numbers when none does;
past the limit after a step, the rows that joined last are preempted and recomputed, their
tokens unchanged. The limit is MLX's real one, read back through MLX's real counters."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import mlx.core as mx
import pytest
from mlx_lm import load

from conftest import WIDE_KV, run_engine
from specd.core.request import GenerationRequest
from specd.core.sampling import SamplingParams
from specd.engine.memory_guard import OUT_OF_MEMORY
from specd.engine.resources import ENGINE_OVERHEAD
from specd.forge.families import build

MiB = 1 << 20


@pytest.fixture(scope="module")
def wide_kv(forged, tmp_path_factory):
    return load(str(build("llama", tmp_path_factory.mktemp("wide-kv") / "llama", forged / "target",
                          overrides=WIDE_KV)))


@contextmanager
def mlx_memory_limit(limit: int):
    previous = mx.set_memory_limit(limit)
    try:
        yield
    finally:
        mx.set_memory_limit(previous)


def request(name: str, prompt_tokens: int, max_tokens: int, tokenizer) -> GenerationRequest:
    """Greedy, never ending early (its end-of-sequence tokens are barred)."""
    bar_eos = tuple((t, -1e9) for t in tokenizer.eos_token_ids)
    prompt = [(11 * i + len(name)) % 500 + 3 for i in range(prompt_tokens)]
    return GenerationRequest(name, prompt, SamplingParams(temperature=0, logit_bias=bar_eos), max_tokens)


async def collect(engine, req: GenerationRequest) -> tuple[list[int], str | None, str | None, list[float]]:
    """The request's tokens, its error and error code, and when each of its outputs came."""
    tokens, error, code, times = [], None, None, []
    async for out in engine.generate(req):
        tokens += out.tokens
        error, code = error or out.error, code or out.error_code
        times.append(time.monotonic())
    return tokens, error, code, times


async def until(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {seconds} s"
        await asyncio.sleep(0.001)


def settle(engine) -> int:
    """MLX's active memory once the engine holds only its weights and the first step's buffers."""
    mx.eval(engine.scheduler.model.parameters())
    mx.clear_cache()
    return mx.get_active_memory()


def test_a_request_without_room_is_refused_with_the_numbers_and_one_with_room_is_served(wide_kv):
    model, tokenizer = wide_kv

    async def go(engine):
        await collect(engine, request("warm", 8, 2, tokenizer))
        kv = engine.scheduler.kv
        short, long = kv.row_bytes(16), kv.row_bytes(2000)
        assert long - short > 16 * MiB
        with mlx_memory_limit(settle(engine) + ENGINE_OVERHEAD + (short + long) // 2):
            refused = await collect(engine, request("long", 2000, 4, tokenizer))
            served = await collect(engine, request("short", 16, 4, tokenizer))
        return refused, served, engine.metrics

    (tokens, error, code, _), (served, served_error, _, _), metrics = run_engine(model, tokenizer, go, prefix_cache_bytes=0)
    assert tokens == [] and code == OUT_OF_MEMORY, (error, code)
    assert "out of memory" in error and "MLX holds" in error and "memory limit" in error, error
    assert served_error is None and len(served) == 4
    assert metrics.request_failure.labels("t", OUT_OF_MEMORY)._value.get() == 1


def test_without_room_a_request_waits_for_the_running_rows_then_runs_unchanged(wide_kv):
    """Room for one long row at a time: the second waits until the first has finished (without
    the limit it would join the batch at once), and its tokens are what it produces alone."""
    model, tokenizer = wide_kv
    first, second = request("first", 1500, 64, tokenizer), request("second", 1500, 24, tokenizer)

    async def alone(engine):
        return [(await collect(engine, r))[0] for r in (first, second)]

    async def limited(engine):
        await collect(engine, request("warm", 8, 2, tokenizer))
        row = engine.scheduler.kv.row_bytes(1500)
        with mlx_memory_limit(settle(engine) + ENGINE_OVERHEAD + row + row // 2):
            a = asyncio.ensure_future(collect(engine, first))
            await until(lambda: engine.scheduler.batch.seqs, "running row")
            b = asyncio.ensure_future(collect(engine, second))
            assert not a.done()  # the second arrives while the first runs
            return await a, await b, engine.metrics

    expected = run_engine(model, tokenizer, alone, prefix_cache_bytes=0)
    (a_tokens, a_error, _, a_times), (b_tokens, b_error, _, b_times), metrics = run_engine(
        model, tokenizer, limited, prefix_cache_bytes=0)
    assert a_error is None and b_error is None
    assert [a_tokens, b_tokens] == expected
    assert b_times[0] > a_times[-1]  # its first token came after the first request's last
    assert metrics.request_failure.labels("t", OUT_OF_MEMORY)._value.get() == 0


def test_past_the_limit_the_rows_that_joined_last_are_preempted_and_finish_unchanged(wide_kv):
    """Three rows decode; MLX's limit drops below what it holds: two rows are preempted (one
    always stays), and once the limit is back they resume. Every row's tokens are the ones it
    produces with no limit at all."""
    model, tokenizer = wide_kv
    requests = [request(f"row{i}", 200 + 50 * i, 160, tokenizer) for i in range(3)]

    async def free(engine):
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    async def squeezed(engine):
        runs = [asyncio.ensure_future(collect(engine, r)) for r in requests]
        await until(lambda: len(engine.scheduler.batch.seqs) == 3, "batch of three")
        preempted = engine.metrics.memory_preemptions.labels("t")
        with mlx_memory_limit(mx.get_active_memory() // 2):
            await until(lambda: preempted._value.get() >= 2, "preemptions")
            held = len(engine.scheduler.batch.seqs)
        return await asyncio.gather(*runs), held, preempted._value.get()

    expected = run_engine(model, tokenizer, free, prefix_cache_bytes=0)
    outputs, held, preemptions = run_engine(model, tokenizer, squeezed, prefix_cache_bytes=0)
    assert held == 1 and preemptions == 2
    assert [o[1] for o in outputs] == [None] * 3
    assert [o[0] for o in outputs] == [e[0] for e in expected]
    assert all(len(o[0]) == 160 for o in outputs)
