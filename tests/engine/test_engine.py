"""The continuous-batching engine, in process, on the forged test target."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import threading
import time
import weakref
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from mlx_lm import load

from conftest import code_sample, counting_steps_run_ahead, measure_plain_decoding_best, run_engine
from specd.core import attention
from specd.core.memory import freeze_startup_objects, return_freed_memory
from specd.core.request import GenerationRequest
from specd.core.sampling import SamplingParams
from specd.engine.engine import Engine, EngineOverloaded
from specd.speculation.hooks import hook, unhook

GREEDY = SamplingParams(temperature=0)
_ids = itertools.count()


@pytest.fixture(scope="module")
def target(forged):
    return load(str(forged / "target"))


async def run(engine: Engine, prompt: list[int], max_tokens: int = 32, params=GREEDY, delay: float = 0.0):
    if delay:
        await asyncio.sleep(delay)
    tokens, text, finish = [], [], None
    request = GenerationRequest(f"r{next(_ids)}", prompt, params, max_tokens)
    async for out in engine.generate(request):
        tokens += out.tokens
        text.append(out.text)
        finish = out.finish_reason
    return tokens, "".join(text), finish


def with_engine(target, fn, **config):
    return run_engine(*target, fn, **config)


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(code_sample("engine"))
    return [ids[i * 7: i * 7 + length + i * 5] for i in range(n)]


def test_chunked_prefill_and_joining_mid_flight_match_solo(target):
    ps = prompts(target[1], 6, 40)

    async def solo(engine):
        return [await run(engine, p, 48) for p in ps]

    async def staggered(engine):
        return await asyncio.gather(*(run(engine, p, 48, delay=0.01 * i) for i, p in enumerate(ps)))

    reference = with_engine(target, solo)
    mixed = with_engine(target, staggered, prefill_step_tokens=16, max_batch_size=4)
    assert [r[0] for r in mixed] == [r[0] for r in reference]
    assert all(r[2] == "length" for r in reference)


def test_streamed_text_is_the_decoded_tokens(target):
    tokenizer = target[1]

    async def go(engine):
        return await asyncio.gather(*(run(engine, p, 64, SamplingParams(temperature=1.0, seed=i))
                                      for i, p in enumerate(prompts(tokenizer, 4, 10))))

    for tokens, text, finish in with_engine(target, go):
        body = [t for t in tokens if t not in tokenizer.eos_token_ids]
        assert text == tokenizer.decode(body)
        assert "\ufffd" not in text or "\ufffd" in tokenizer.decode(body)


def test_context_limit_finishes_with_length(target):
    prompt = prompts(target[1], 1, 60)[0]

    async def go(engine):
        return await run(engine, prompt, 1000)

    tokens, _, finish = with_engine(target, go, max_context=len(prompt) + 5)
    assert finish == "length" and len(tokens) == 5


def test_waiting_queue_is_bounded(target):
    prompt = prompts(target[1], 1, 8)[0]

    async def go(engine):
        first = engine.generate(GenerationRequest("first", prompt, GREEDY, 300))
        await anext(first)  # it now holds the only batch slot
        queued = [asyncio.ensure_future(run(engine, prompt, 4)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded):
            engine.submit(GenerationRequest("extra", prompt, GREEDY, 4), lambda out: None)
        rest = [out async for out in first]
        return rest[-1].finish_reason, await asyncio.gather(*queued)

    finish, queued = with_engine(target, go, max_batch_size=1, max_waiting=2)
    assert finish == "length" and [r[2] for r in queued] == ["length", "length"]


def test_an_engine_fault_fails_its_requests_and_the_engine_keeps_serving(target):
    """A fault in the step that samples a prefill group's first tokens (the
    decode forward, which also evaluates the group's last prefill chunk: the
    group has just left the prefill for the batch) fails those requests
    instead of leaving them waiting, and the next request is served."""
    model, tokenizer = target
    prompt = prompts(tokenizer, 1, 8)[0]
    # lazy, on this thread's stream: the engine thread cannot evaluate it (what
    # an array built at load time in another thread does)
    poisoned = mx.zeros((1,)) + 1
    faults = [True, False]  # popped from the end: the prefill chunk's logits are never evaluated

    def around(call, *args, **kwargs):
        out = call(*args, **kwargs)
        return out + poisoned if faults and faults.pop() else out

    async def go(engine):
        hook(model, around)  # after the engine's warm-up forward at load
        try:
            request = GenerationRequest("faulty", prompt, GREEDY, 4)
            outputs = await asyncio.wait_for(_collect(engine.generate(request)), 30)
            fault = (engine.fault, engine.faults)
            served = await asyncio.wait_for(run(engine, prompt, 4), 30)
            for _ in range(600):  # the engine thread clears the fault after the step that delivered the output
                if engine.fault is None:
                    break
                await asyncio.sleep(0.05)
            return outputs[-1], fault, served, engine.fault
        finally:
            unhook(model, around)

    failed, fault, (tokens, _, finish), recovered = with_engine(target, go)
    assert failed.error and "engine error" in failed.error and not faults
    assert fault[0] is not None and "Stream" in fault[0] and fault[1] == 1  # the Model is Degraded until...
    assert finish == "length" and len(tokens) == 4 and recovered is None  # ...a step succeeds


def test_a_fault_while_failing_requests_still_ends_them(target):
    """A fault in a step whose clean-up (releasing the failed rows from the
    speculator) faults too: the requests still end with the engine error, and
    the engine thread lives to serve the next request."""
    model, tokenizer = target
    prompt = prompts(tokenizer, 1, 8)[0]
    poisoned = mx.zeros((1,)) + 1  # lazy, on this thread's stream: the engine thread cannot evaluate it
    faults = [True, False]  # popped from the end: the decode forward of the first token

    def around(call, *args, **kwargs):
        out = call(*args, **kwargs)
        return out + poisoned if faults and faults.pop() else out

    async def go(engine):
        broken = break_once(engine.scheduler.speculator, "release")
        hook(model, around)
        try:
            failed = await asyncio.wait_for(_collect(engine.generate(GenerationRequest("f", prompt, GREEDY, 4))), 30)
            served = await asyncio.wait_for(run(engine, prompt, 4), 30)
            return failed[-1], served, broken
        finally:
            unhook(model, around)

    failed, (tokens, _, finish), broken = with_engine(target, go)
    assert failed.error and "engine error" in failed.error and not broken
    assert finish == "length" and len(tokens) == 4


def break_once(owner, name: str) -> list[bool]:
    """Make ``owner.name`` raise at its next call, then work again; ``[True]`` until it has raised."""
    call, broken = getattr(owner, name), [True]

    def once_broken(*args, **kwargs):
        if broken and broken.pop():
            raise RuntimeError(f"{name} broke")
        return call(*args, **kwargs)
    setattr(owner, name, once_broken)
    return broken


def test_a_fault_during_admission_fails_the_requests_it_had_taken_from_the_queue(target):
    """A fault while admission moves requests from the queue into a prefill group (here, reading
    how much of a prompt the prefix cache may serve) leaves them in neither: they still end with
    the engine error rather than wait forever, and the next request is served."""
    model, tokenizer = target
    prompt = prompts(tokenizer, 1, 8)[0]

    async def go(engine):
        broken = break_once(engine.scheduler.speculator, "prefix_limit")
        failed = await asyncio.wait_for(_collect(engine.generate(GenerationRequest("f", prompt, GREEDY, 4))), 30)
        served = await asyncio.wait_for(run(engine, prompt, 4), 30)
        return failed[-1], served, broken

    failed, (tokens, _, finish), broken = with_engine(target, go)
    assert failed.error and "prefix_limit broke" in failed.error and not broken
    assert finish == "length" and len(tokens) == 4


async def _collect(outputs):
    return [out async for out in outputs]


def test_a_model_that_builds_arrays_at_load_time_serves_from_the_engine_thread(forged, tmp_path):
    """Llama 3 RoPE scaling computes its frequencies when the model is built
    (arrays that are not parameters): ``load_model`` evaluates them, so the
    engine thread can run the model; its greedy output is mlx-lm's."""
    import json
    import shutil

    from mlx_lm.generate import generate_step

    from specd.core.loader import load_model

    shutil.copytree(forged / "target", tmp_path / "llama3")
    config_path = tmp_path / "llama3" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    config_path.write_text(json.dumps(config))
    model, tokenizer = load_model(str(tmp_path / "llama3"))
    prompt = prompts(tokenizer, 1, 12)[0]

    async def go(engine):
        return await asyncio.wait_for(run(engine, prompt, 16), 60)
    tokens, _, finish = run_engine(model, tokenizer, go)  # first: the reference would evaluate them here
    reference = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    assert tokens == reference and finish == "length"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc")
def test_a_drain_s_grace_runs_while_the_process_does(target):
    """A worker stopped (SIGSTOP) in the middle of a drain resumed with its grace spent by the
    clock and failed the requests it was finishing: "engine stopped" in the cluster soak. Here the
    engine thread is held between steps and the event loop blocked for longer than the grace,
    as a stopped process is; afterwards the drain goes on and the request finishes."""
    _, tokenizer = target
    prompt = tokenizer.encode("def add(a, b):")

    async def fn(engine: Engine):
        held, first = threading.Event(), asyncio.Event()

        async def request():
            out = []
            async for o in engine.generate(GenerationRequest(f"r{next(_ids)}", prompt, GREEDY, 64)):
                out.append(o)
                first.set()
            return out
        task = asyncio.ensure_future(request())
        await first.wait()
        engine.inbox.between_steps(lambda: held.wait(30))  # the engine thread stops between steps
        drain = asyncio.ensure_future(engine.shutdown(3.0))
        await asyncio.sleep(0.1)
        time.sleep(4.0)  # the process stopped: the loop does not run either
        await asyncio.sleep(0.3)
        still_draining = not engine.inbox.stopped
        held.set()
        await drain
        return still_draining, await task
    still_draining, outputs = with_engine(target, fn)
    assert still_draining
    assert outputs[-1].error is None and outputs[-1].finish_reason in ("length", "stop")


def test_engines_that_stop_leave_no_threads_behind(target):
    """MLX keeps a thread for every stream until the process ends, and streams belong to the thread
    that made them: Models that load and unload (scale to zero, reloads) must not leave threads behind."""
    ps = prompts(target[1], 2, 40)

    async def two_rows(engine):  # two rows attend on streams of their own (dealt even on one core)
        return await asyncio.gather(*(run(engine, p, 4) for p in ps))

    def threads() -> int:
        """The process's threads, once those that just ended have left /proc too (a Python
        thread is joined before its task exits)."""
        count = len(os.listdir("/proc/self/task"))
        for _ in range(40):
            time.sleep(0.05)
            count, settled = len(os.listdir("/proc/self/task")), count
            if count == settled:
                break
        return count

    with mock.patch.object(attention, "CPU_STREAMS", 3):
        counts = []
        for _ in range(4):
            with_engine(target, two_rows)
            counts.append(threads())
    assert counts[1:] == [counts[0]] * 3, counts


def test_an_engine_that_stops_leaves_its_model_to_be_freed(forged):
    """The thread an engine ran on waits for the next engine: it must not keep the last one alive,
    and with it the model's weights, or a Model scaled to zero would keep its memory."""
    model, tokenizer = load(str(forged / "target"))
    prompt = prompts(tokenizer, 1, 40)[0]
    run_engine(model, tokenizer, lambda engine: run(engine, prompt, 4))
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None, [type(r).__name__ for r in gc.get_referrers(freed())]


def test_an_engine_made_after_the_daemon_froze_its_startup_objects_is_still_collected(forged):
    """The daemon leaves what its start-up made out of collections (``freeze_startup_objects``);
    an engine made afterwards must still be freed by the drain's collection, cycles and all."""
    freeze_startup_objects()
    try:
        model, tokenizer = load(str(forged / "target"))
        prompt = prompts(tokenizer, 1, 40)[0]
        engines = []

        async def serve_one(engine):
            engines.append(weakref.ref(engine))
            return await run(engine, prompt, 4)
        run_engine(model, tokenizer, serve_one)
        freed = weakref.ref(model)
        del model, tokenizer
        assert engines[0]() is not None, "the engine's objects refer to one another: only a collection frees them"
        return_freed_memory(cycles=True)
        assert engines[0]() is None and freed() is None
    finally:
        gc.unfreeze()


def test_a_request_becomes_a_sequence_on_the_engine_thread_never_on_the_event_loop(target):
    """Submitting costs the event loop no MLX work: a request's RNG key (``mx.random.key``) and
    its grammar's matcher are made on the engine's thread when it takes the request, and a
    grammar that cannot start ends its request with the reason instead of failing the engine."""
    import threading

    from specd.core import sequence
    from specd.core.grammar import json_schema_grammar
    from specd.engine import scheduler
    made: list[tuple[str, threading.Thread]] = []

    def recorded(name, make):
        def wrapper(*args, **kwargs):
            made.append((name, threading.current_thread()))
            return make(*args, **kwargs)
        return wrapper
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})

    async def go(engine):
        loop_thread = threading.current_thread()
        tokens, _, _ = await run(engine, prompts(target[1], 1, 12)[0], 8, SamplingParams(temperature=0.7, seed=3))
        request = GenerationRequest(f"r{next(_ids)}", prompts(target[1], 1, 12)[0], GREEDY, 8, grammar=grammar)
        constrained = [out async for out in engine.generate(request)]
        broken = GenerationRequest(f"r{next(_ids)}", prompts(target[1], 1, 12)[0], GREEDY, 8, grammar="%%% not a grammar")
        failed = [out async for out in engine.generate(broken)]
        after, _, finish = await run(engine, prompts(target[1], 1, 12)[0], 4)
        return loop_thread, tokens, constrained, failed, finish
    with mock.patch.object(sequence, "make_key", recorded("key", sequence.make_key)), \
            mock.patch.object(scheduler, "Constraint", recorded("grammar", scheduler.Constraint)):
        loop_thread, tokens, constrained, failed, finish = with_engine(target, go)
    assert len(tokens) == 8 and constrained[-1].error is None and constrained[-1].finish_reason
    assert {name for name, _ in made} == {"key", "grammar"}
    assert all(thread is not loop_thread and thread.name.startswith("engine-") for _, thread in made), made
    assert len(failed) == 1 and failed[0].error.startswith("GrammarError"), failed
    assert finish == "length"  # the engine serves on


def test_a_goodput_policy_that_measured_plain_decoding_best_runs_ahead(target):
    """Rows asking to speculate, under a goodput policy whose measurements say plain decoding pays
    best (no try due), start each step before the last one's tokens are read, as spec-off rows do,
    and write what stepping whole writes. The policy is told which plain steps ran ahead (its
    measurements value plain decoding at their pace), and that none could where none may."""
    from specd.core.request import SpeculationConfig

    ngram = SpeculationConfig("ngram", 3)

    async def go(engine):
        await measure_plain_decoding_best(engine)

        async def one(prompt):
            request = GenerationRequest(f"r{next(_ids)}", prompt, GREEDY, 30, speculation=ngram)
            return [t async for out in engine.generate(request) for t in out.tokens]
        tokens = await asyncio.gather(*(one(p) for p in prompts(target[1], 4, 30)))
        return tokens, engine.scheduler.speculator.feedback.realised[4].plain_pace
    whole, paces_whole = with_engine(target, go, decode_ahead=False)
    with counting_steps_run_ahead() as taken:
        ahead, paces_ahead = with_engine(target, go, decode_ahead=True)
    assert ahead == whole
    assert taken[0] > 20, taken
    assert paces_whole == {} and True in paces_ahead


def test_running_ahead_changes_no_token(target):
    """Plain steps that start the next before reading their tokens (``decode_ahead``) give every
    request exactly what stepping whole gives: greedy and seeded sampled rows, a row with a
    ``logit_bias``, rows that leave at different lengths, and rows that join mid-flight, among
    them one that speculates, so that steps run ahead are both taken and dropped (each row then
    forgets its column and gets its RNG key back)."""
    from specd.core.request import SpeculationConfig
    from specd.engine import runner as runner_module
    ps = prompts(target[1], 6, 30)
    sampled = SamplingParams(temperature=0.9, seed=21)
    biased = SamplingParams(temperature=0, logit_bias=((ps[0][3], 6.0),))
    cases = [(ps[0], GREEDY, 40, None, 0.0), (ps[1], sampled, 33, None, 0.0), (ps[2], biased, 25, None, 0.02),
             (ps[3], sampled, 45, None, 0.05), (ps[4], GREEDY, 30, SpeculationConfig("ngram", 3), 0.08),
             (ps[5], GREEDY, 12, None, 0.1)]
    taken = dropped = 0
    original = runner_module.ModelRunner._ahead_for

    def counted(self, step):
        nonlocal taken, dropped
        had = self.ahead is not None
        launched = original(self, step)
        taken += launched is not None
        dropped += had and launched is None
        return launched

    async def go(engine):
        async def one(prompt, params, max_tokens, speculation, delay):
            await asyncio.sleep(delay)
            request = GenerationRequest(f"r{next(_ids)}", prompt, params, max_tokens, speculation=speculation)
            return [t async for out in engine.generate(request) for t in out.tokens]
        return await asyncio.gather(*(one(*case) for case in cases))
    whole = with_engine(target, go, decode_ahead=False)
    with mock.patch.object(runner_module.ModelRunner, "_ahead_for", counted):
        ahead = with_engine(target, go, decode_ahead=True)
    assert ahead == whole
    assert [len(tokens) for tokens in whole] == [case[2] for case in cases]
    assert taken > 20 and dropped >= 1, (taken, dropped)
