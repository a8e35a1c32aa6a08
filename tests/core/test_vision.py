"""Images in the engine: tiny random vision-language checkpoints (``specd.forge.vision``) read
by mlx-vlm's loader, served by specd's engine, against mlx-vlm's own generation."""

from __future__ import annotations

import io
import itertools
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from conftest import run_engine
from specd.core.loader import load_model
from specd.core.request import GenerationRequest, SpeculationConfig, Method
from specd.core.sampling import SamplingParams
from specd.core.vision import IMAGE_KEY_BASE, VisionTower, VisionUnavailable, pixel_digest, without_text_kwargs
from specd.forge.dflash import fresh_drafter
from specd.forge.mtp import fresh_head
from specd.forge.vision import build

GREEDY = SamplingParams(temperature=0.0)
TOKENS = 12
SERVED = ("gemma3", "llava", "qwen2_5_vl")  # qwen2_5_vl: its image tokens take (t, h, w) rotary positions
_ids = itertools.count()


def picture(seed: int, size: tuple[int, int] = (90, 100), fmt: str = "PNG") -> Image.Image:
    """A test image, through real encoded bytes (PNG or JPEG) and back."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]]
    pixels = np.stack([x * 255 // size[0], y * 255 // size[1], rng.integers(0, 256, size[::-1])], -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, fmt)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


@pytest.fixture(scope="module")
def vision_models(forged, tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    return {family: build(family, root / family, forged / "target", seed=3) for family in (*SERVED, "qwen3_vl")}


@pytest.fixture(scope="module")
def loaded(vision_models):
    out = {}
    for family in SERVED:
        model, tokenizer = load_model(str(vision_models[family]))
        out[family] = (model, tokenizer, VisionTower(vision_models[family], model))
    return out


def rendered(tokenizer, text: str, images: int) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def request(vision: VisionTower, tokenizer, text: str, images: list[Image.Image], **kw) -> GenerationRequest:
    prompt = rendered(tokenizer, text, len(images))
    if not images:
        return GenerationRequest(f"v{next(_ids)}", tokenizer.encode(prompt, add_special_tokens=False), GREEDY,
                                 TOKENS, **kw)
    tokens, prepared = vision.prepare(prompt, images, tuple(pixel_digest(i) for i in images))
    return GenerationRequest(f"v{next(_ids)}", tokens, GREEDY, TOKENS, images=prepared, **kw)


async def answer(engine, req: GenerationRequest) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in engine.generate(req):
        assert out.error is None, out.error
        tokens += out.tokens
        cached = out.cached_tokens
    return tokens, cached


async def scored(engine, req: GenerationRequest) -> tuple[list[int], list[float]]:
    """Greedy tokens and the log-probability of each."""
    tokens, logprobs = [], []
    async for out in engine.generate(replace(req, params=SamplingParams(temperature=0.0, logprobs=True))):
        assert out.error is None, out.error
        tokens += out.tokens
        logprobs += [lp.logprob for lp in out.logprobs or []]
    return tokens, logprobs


def mlx_vlm_greedy(path, text: str, images: list[Image.Image]) -> tuple[list[int], list[float]]:
    """mlx-vlm's own greedy generation for the same rendered prompt and images: its tokens and
    the log-probability of each."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(path))
    without_text_kwargs(processor)
    tokens, logprobs = [], []
    for out in stream_generate(model, processor, text, image=images, max_tokens=TOKENS, temperature=0.0):
        tokens.append(out.token)
        logprobs.append(float(np.asarray(out.logprobs).reshape(-1)[out.token]))
    return tokens[:TOKENS], logprobs[:TOKENS]  # its last result repeats the ending


@pytest.mark.parametrize("family", SERVED)
def test_greedy_output_equals_mlx_vlms_own_generation(family, loaded, vision_models):
    model, tokenizer, vision = loaded[family]
    image = picture(1)
    req = request(vision, tokenizer, "Describe this image.", [image])
    assert req.prompt_tokens.count(vision.token_id) > 0
    got, logprobs = run_engine(model, tokenizer, lambda e: scored(e, req), vision=vision)
    want, want_logprobs = mlx_vlm_greedy(vision_models[family], rendered(tokenizer, "Describe this image.", 1),
                                         [image])
    assert got == want and len(got) == TOKENS
    # the same distribution, not only its argmax: a tiny random model's greedy tokens can survive
    # positions that are off (Qwen-VL's mrope), its log-probabilities cannot
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-3
    other, _ = run_engine(model, tokenizer, lambda e: answer(e, request(vision, tokenizer, "Describe this image.",
                                                                        [picture(2)])), vision=vision)
    assert other != got, "the image changes nothing: the features never reach the language model"


@pytest.mark.parametrize("family", SERVED)
def test_a_batch_mixing_image_and_text_rows_gives_each_row_what_it_gives_alone(family, loaded):
    model, tokenizer, vision = loaded[family]
    asks = [("Describe this image.", [picture(1)]), ("Write a poem about the sea.", []),
            ("What is in the picture? Answer briefly.", [picture(4, (64, 48), "JPEG")]),
            ("Compare the two.", [picture(5), picture(6)]), ("def fib(n):", [])]

    async def alone(engine):
        return [await answer(engine, request(vision, tokenizer, text, images)) for text, images in asks]

    async def together(engine):
        import asyncio

        async def staggered(i, text, images):
            await asyncio.sleep(0.05 * i)
            return await answer(engine, request(vision, tokenizer, text, images))
        return await asyncio.gather(*(staggered(i, t, im) for i, (t, im) in enumerate(asks)))

    want = run_engine(model, tokenizer, alone, vision=vision, prefix_cache_bytes=0)
    got = run_engine(model, tokenizer, together, vision=vision, prefix_cache_bytes=0, prefill_step_tokens=32)
    assert [t for t, _ in got] == [t for t, _ in want]


def test_a_resent_image_is_a_prefix_hit_and_another_image_is_not(loaded, monkeypatch):
    model, tokenizer, vision = loaded["gemma3"]
    encoded = []
    monkeypatch.setattr(vision, "embeddings", lambda p, i, f=vision.embeddings: encoded.append(1) or f(p, i))
    first = request(vision, tokenizer, "Describe this image.", [picture(1)])
    span = first.prompt_tokens.index(vision.token_id) + first.prompt_tokens.count(vision.token_id)

    async def go(engine):
        a = await answer(engine, first)
        again = await answer(engine, request(vision, tokenizer, "Describe this image.", [picture(1)]))
        other = await answer(engine, request(vision, tokenizer, "Describe this image.", [picture(2)]))
        return a, again, other
    (a, a_cached), (again, again_cached), (other, other_cached) = run_engine(model, tokenizer, go, vision=vision)
    assert a_cached == 0 and again == a
    assert again_cached > span, "the resent image's tokens were not served from the prefix cache"
    assert other_cached < first.prompt_tokens.index(vision.token_id) + 1, "another image matched the cache"
    assert len(encoded) == 2, "the vision tower ran for an image the prefix cache held"
    keys = first.images.keys(first.prompt_tokens)
    assert {k for k in keys if k >= IMAGE_KEY_BASE} and vision.token_id not in keys


@pytest.mark.parametrize("family", SERVED)
def test_ngram_speculation_is_lossless_with_images(family, loaded):
    model, tokenizer, vision = loaded[family]
    ngram = SpeculationConfig(Method.NGRAM, 3, 1, 3)
    text = "Repeat after me: one two three one two three one two three."

    async def go(engine, speculation):
        return await answer(engine, request(vision, tokenizer, text, [picture(7)], speculation=speculation))
    plain, _ = run_engine(model, tokenizer, lambda e: go(e, None), vision=vision)
    spec, _ = run_engine(model, tokenizer, lambda e: go(e, ngram), vision=vision)
    assert spec == plain


def test_qwen3_vl_deepstack_is_refused_with_its_reason(vision_models):
    model, _ = load_model(str(vision_models["qwen3_vl"]))
    with pytest.raises(VisionUnavailable, match="deepstack"):
        VisionTower(vision_models["qwen3_vl"], model)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_every_drafter_is_lossless_with_images(family, loaded, forged, tmp_path):
    """A draft model (the forge's draft as a LLaVA's text half: the target's tokens), an EAGLE
    head, an MTP head and a DFlash drafter draft from the tokens (the heads from the target's
    features over the image rows too); in a staggered batch of image and text rows, chains and trees,
    every row gives the tokens, and their log-probabilities, it gives without speculation (a
    Qwen-VL row's tree tokens rotated at its shifted offsets)."""
    import asyncio

    from conftest import head_for

    model, tokenizer, vision = loaded[family]
    asks = [("Describe this image.", [picture(1)]), ("def fib(n):", []),
            ("What is in the picture?", [picture(4, (64, 48), "JPEG")]), ("Compare the two.", [picture(5), picture(6)])]

    def run(drafter, mixes):
        async def go(engine):
            async def one(i, text, images, spec):
                await asyncio.sleep(0.03 * i)
                return await scored(engine, request(vision, tokenizer, text, images, speculation=spec))
            rows = await asyncio.gather(*(one(i, t, im, s) for i, ((t, im), s) in enumerate(zip(asks, mixes))))
            return rows, engine.scheduler.speculator.feedback.drafted_total
        return run_engine(model, tokenizer, go, draft_model=drafter, vision=vision, prefix_cache_bytes=0)

    def same(got, want):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, g), (_, w) in zip(got, want) for a, b in zip(g, w)) < 1e-4

    plain, _ = run(None, [None] * len(asks))
    if family == "llava":
        draft, _ = load_model(str(build("llava", tmp_path / "draft", forged / "target", seed=3,
                                        language_model=forged / "draft")))
        draft_rows, drafted = run(draft, [SpeculationConfig(Method.DRAFT, 3)] * len(asks))
        same(draft_rows, plain)
        assert drafted > 0
    chain, tree = SpeculationConfig(Method.EAGLE, 3), SpeculationConfig(Method.EAGLE, 3, tree_top_k=2, tree_tokens=6)
    eagle_rows, drafted = run(head_for(model, 1), [chain, tree, tree, chain])
    same(eagle_rows, plain)
    assert drafted > 0
    mtp_rows, drafted = run(fresh_head(model, seed=1), [SpeculationConfig(Method.MTP, 3)] * len(asks))
    same(mtp_rows, plain)
    assert drafted > 0
    block, block_tree = SpeculationConfig(Method.DFLASH, 5), SpeculationConfig(Method.DFLASH, 4, tree_top_k=2, tree_tokens=6)
    dflash_rows, drafted = run(fresh_drafter(model, seed=1), [block, block_tree, block, block_tree])
    same(dflash_rows, plain)
    assert drafted > 0


def test_the_vision_tower_counts_in_the_models_memory_request(vision_models, loaded):
    from specd.api.manifest import ModelSpec
    from specd.core.loader import weight_bytes
    from specd.engine.resources import memory_request

    model, _, vision = loaded["gemma3"]
    request = memory_request(ModelSpec(source=str(vision_models["gemma3"])), None, 8 << 30, local_only=True)
    loaded_bytes = weight_bytes(model) + vision.weight_bytes  # a few computed arrays are in no file
    assert vision.weight_bytes > 0.1 * request.weights and abs(request.weights - loaded_bytes) < 0.01 * loaded_bytes
