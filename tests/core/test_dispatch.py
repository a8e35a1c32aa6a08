"""Decoder layers started on MLX's CPU stream as a decode step builds them: the same numbers, and
nothing started outside a decode step's forwards (prefill, training, a model called directly)."""

from __future__ import annotations

import asyncio
import contextlib

import mlx.core as mx
import mlx.nn as nn
import pytest

from specd.core import dispatch
from specd.core.cache import make_row_cache
from specd.core.loader import load_model
from specd.core.model_parts import decoder
from specd.core.request import GenerationRequest, Method, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.speculation.eagle.capture import FeatureCapture
from conftest import run_engine


@pytest.fixture
def started(monkeypatch) -> list[int]:
    """Counts the arrays handed to ``mx.async_eval`` from a dispatching layer's call."""
    calls: list[int] = []
    original = mx.async_eval

    def counting(*arrays):
        calls.append(len(arrays))
        return original(*arrays)
    monkeypatch.setattr(mx, "async_eval", counting)
    return calls


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


# plain attention, sliding windows with a global layer, and a hybrid of recurrent and attention layers
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_a_decode_step_starts_each_layer_and_computes_the_same(family, family_models, started, monkeypatch):
    model, tokenizer = load_model(str(family_models(family)))
    layers = decoder(model).layers
    assert all("_specd_dispatches" in type(layer).__dict__ for layer in layers)
    prompt = mx.array([tokenizer.encode("def parse(line):\n    return line.split()")[:12]] * 2)
    logits = {}
    for arm in ("dispatched", "built whole"):
        monkeypatch.setattr(dispatch, "forwards", dispatch.forwards if arm == "dispatched" else contextlib.nullcontext)
        cache = make_row_cache(model, [0, 0])
        started.clear()
        prefill = cache.forward(model, prompt)
        assert started == []  # a prefill chunk is built whole
        with dispatch.forwards():
            step = cache.forward(model, mx.array([[5], [7]]))
        assert len(started) == (len(layers) if arm == "dispatched" else 0)
        logits[arm] = mx.concatenate([prefill[:, -1], step[:, -1]])
    assert same(logits["dispatched"], logits["built whole"])


def test_nothing_starts_outside_a_decode_step(forged, started):
    model, _ = load_model(str(forged / "target"))
    tokens = mx.array([[1, 2, 3, 4]])
    mx.eval(model(tokens))

    def loss(model: nn.Module, tokens: mx.array) -> mx.array:
        return model(tokens).sum()
    mx.eval(nn.value_and_grad(model, loss)(model, tokens))  # training traces the layers: it must not evaluate
    assert started == []


def test_engines_decode_the_same_dispatched_or_not(forged, monkeypatch):
    """Greedy plain and speculating rows, in one batch, through the engine (layers started by the
    runner's plain and verify forwards and by the draft model's steps)."""
    target, tokenizer = load_model(str(forged / "target"))
    draft, _ = load_model(str(forged / "draft"))
    prompts = [tokenizer.encode(p) for p in ("def add(a, b):", "class Stack:\n    def push(self, x):",
                                             "import os\nimport sys\n", "for i in range(10):")]
    specs = [None, SpeculationConfig(Method.DRAFT, 3), SpeculationConfig(Method.NGRAM, 2), None]

    async def generate(engine) -> list[list[int]]:
        async def one(i: int) -> list[int]:
            request = GenerationRequest(f"r{i}", prompts[i], SamplingParams(temperature=0), 24, speculation=specs[i])
            return [t for out in [o async for o in engine.generate(request)] for t in out.tokens]
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    outputs = {}
    for arm in ("dispatched", "built whole"):
        monkeypatch.setattr(dispatch, "forwards", dispatch.forwards if arm == "dispatched" else contextlib.nullcontext)
        outputs[arm] = run_engine(target, tokenizer, generate, draft_model=draft)
    assert outputs["dispatched"] == outputs["built whole"]
    assert all(len(tokens) == 24 for tokens in outputs["dispatched"])


def test_a_hook_on_a_dispatching_layer_composes(forged):
    """EAGLE-3 hooks decoder layers to keep their outputs: over a dispatching layer's class, and
    removing the hook gives that class back."""
    model, _ = load_model(str(forged / "target"))
    layers = decoder(model).layers
    dispatching = [type(layer) for layer in layers]
    capture = FeatureCapture(model, (0, 1))
    cache = make_row_cache(model, [0])
    with dispatch.forwards():
        mx.eval(cache.forward(model, mx.array([[1, 2, 3]])))
    assert capture.take().shape == (1, 3, 2 * model.args.hidden_size)
    capture.remove()
    assert [type(layer) for layer in layers] == dispatching
