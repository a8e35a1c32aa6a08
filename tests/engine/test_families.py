"""Every model family mlx-lm serves, batched and speculating.

One tiny random-weight model per family, built from the family's real
config shape (``specd.forge.families``) and loaded through ``mlx_lm.load``.
Sliding windows are a few tokens wide, so prompt plus completion wraps them
while speculation rolls back; recurrent families roll their state back.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from conftest import code_sample, free_port, model_manifest, run_engine
from specd.core.cache import make_row_cache, padding_leaks, runs_row_by_row
from specd.core import attention, layout
from specd.core.loader import load_model
from specd.core.request import GenerationRequest, SpeculationConfig
from specd.core.sampling import SamplingParams
from specd.forge.families import (FAMILIES, METAL_ONLY, NOT_SERVED, SHAPES, UNFORGEABLE, build, model_types,
                                   served_families)
from specd.speculation.hooks import hook, unhook

GREEDY = SamplingParams(temperature=0)
NGRAM = SpeculationConfig("ngram", 4, 1, 3)
DRAFT = SpeculationConfig("draft", 3)
MAX_TOKENS = 40
AFFINE_4BIT = {"group_size": 64, "bits": 4, "mode": "affine"}
AFFINE_8BIT = {"group_size": 64, "bits": 8, "mode": "affine"}
QUANTIZED = [("llama", AFFINE_4BIT), ("gemma3_text", AFFINE_4BIT), ("qwen3_next", AFFINE_4BIT),
             ("gpt_oss", {"group_size": 32, "bits": 4, "mode": "mxfp4"}),  # as mlx-community publishes gpt-oss
             ("gemma4_text", AFFINE_8BIT), ("granitemoehybrid", AFFINE_8BIT)]
_ids = itertools.count()


def prompts(tokenizer) -> list[list[int]]:
    """Four prompts of different lengths: three code snippets, one repetitive so n-gram
    lookup finds matches, and one holding each distinct token of the code sample once,
    far longer than a window, so a short row prefilled beside it is padding for many
    chunks and nearly any token a random model writes was seen before (prompt lookup
    proposes, and is mostly rejected, whatever the family)."""
    ids = tokenizer.encode(code_sample("speculation"))
    return [ids[:11], ids[300:322], ids[40:52] * 3, list(dict.fromkeys(ids))]


def reference(model, tokenizer, prompt: list[int]) -> list[int]:
    """mlx-lm's own greedy decoding of ``prompt`` alone, up to its first end of text."""
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


async def generate(engine, prompt, spec=None, delay=0.0) -> list[int]:
    await asyncio.sleep(delay)
    request = GenerationRequest(f"f{next(_ids)}", prompt, GREEDY, MAX_TOKENS, (), spec)
    tokens = []
    async for out in engine.generate(request):
        assert out.error is None, out.error
        tokens += out.tokens
    return tokens


def staggered(model, tokenizer, batch: list[list[int]], spec=None, draft=None) -> list[list[int]]:
    """The prompts in one engine, arriving a little apart so rows join a batch
    mid-flight; ``spec`` is one for all, or one per prompt (a mixed batch).  A
    speculating run must have had proposals rejected (rolled back)."""
    specs = spec if isinstance(spec, list) else [spec] * len(batch)

    async def go(engine):
        out = await asyncio.gather(*(generate(engine, p, s, 0.01 * i) for i, (p, s) in enumerate(zip(batch, specs))))
        speculator = engine.scheduler.speculator
        return out, speculator.feedback.drafted_total, speculator.feedback.accepted_total
    out, drafted, accepted = run_engine(model, tokenizer, go, draft, max_batch_size=4, prefill_step_tokens=16)
    if any(specs) and draft is not model:
        assert drafted > accepted, f"{drafted} tokens drafted, {accepted} accepted: nothing was rolled back"
    return out


def check_family(path: Path, draft_path: Path | None = None) -> None:
    """Batched and staggered output equals mlx-lm's alone: spec off and n-gram, or (given a
    draft) draft-model speculation, alone and mixed with the others."""
    model, tokenizer = load_model(str(path))
    batch = prompts(tokenizer)
    expected = [reference(model, tokenizer, p) for p in batch]
    if draft_path is None:
        assert staggered(model, tokenizer, batch) == expected, "batched spec-off differs from mlx-lm alone"
        assert staggered(model, tokenizer, batch, NGRAM) == expected, "n-gram speculation changed the output"
        assert staggered(model, tokenizer, batch, [NGRAM, None, NGRAM, None]) == expected, "a mixed batch changed it"
    else:
        draft, _ = load_model(str(draft_path))
        for drafter in (draft, model):  # mostly rejected, then always accepted
            mixed = [DRAFT, NGRAM, None, DRAFT]
            assert staggered(model, tokenizer, batch, DRAFT, drafter) == expected, "draft speculation changed it"
            assert staggered(model, tokenizer, batch, mixed, drafter) == expected, "a mixed batch changed it"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_mlx_lm_batched_and_speculating(family, family_models):
    check_family(family_models(family))


@pytest.mark.parametrize("path", ["row by row", "block", "gathered", "dealt to streams"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3", "qwen3_moe", "qwen3_next", "lfm2", "gpt_oss"])
def test_other_attention_paths_match_mlx_lm(family, path, family_models, monkeypatch):
    """Each way a step may attend is as exact as mlx-lm: every row by row (the reference), the
    rows' columns as one block wherever that layout may be taken (``layout.LAYOUT``, what the
    measured costs pick for short rows), the attention a GPU runs for rows read in pieces
    (``attention.gathers``: a layer's rows in one pass), and rows dealt to CPU streams
    (``attention.deal``: what a CPU of several cores runs for long rows, here every row): plain,
    sliding-window, mixture-of-experts, hybrid recurrent and attention-sink families."""
    monkeypatch.setattr(layout, "LAYOUT", "block" if path == "block" else "rows")
    if path == "gathered":
        monkeypatch.setattr(attention, "gathers", lambda: True)
    elif path == "dealt to streams":
        monkeypatch.setattr(attention, "DEAL_MIN_SCORES", 0)
        monkeypatch.setattr(attention, "CPU_STREAMS", 3)
    check_family(family_models(family))


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next", "olmo_hybrid", "deepseek_v41"])
def test_draft_models_of_rotating_and_recurrent_families(family, family_models):
    """Draft speculation (spec off and n-gram are ``test_family_matches_mlx_lm_batched_and_speculating``'s)."""
    check_family(family_models(family), family_models(family, seed=1))


# KV-shared layers with windows wider than the prompts, so they wrap inside speculation rounds
# rather than before the first, or narrower than a round (n-gram's k of 4 verifies 5 tokens), so they
# wrap inside every round. Gemma 3n and Gemma 4 (their last layers read the keys and values of the
# last concrete layer of their kind) run row by row over mlx-lm's own caches.
_GEMMA3N_SHARED = {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                   "layer_types": ["full_attention", "sliding_attention"] * 2,
                   "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]}
WRAPPING_INSIDE_A_ROUND = {"gemma3n, window 16": ("gemma3n", {**_GEMMA3N_SHARED, "sliding_window": 16}),
                           "gemma3n, window 4": ("gemma3n", {**_GEMMA3N_SHARED, "sliding_window": 4}),
                           "gemma4_text, window 16": ("gemma4_text", {"sliding_window": 16}),
                           "gemma4_text, window 4": ("gemma4_text", {"sliding_window": 4})}


@pytest.mark.parametrize("shape", sorted(WRAPPING_INSIDE_A_ROUND))
def test_a_row_by_row_window_that_wraps_inside_a_speculation_round_rolls_back_exactly(shape, forged, tmp_path):
    """A round that carries a row's sliding window past its width leaves mlx-lm's cache untrimmable
    (its trim keeps the columns the forward wrote in the buffer, and the next one-token write
    drops an older column the row still attends to instead of them), so the row's caches are
    kept from before the round and its kept tokens run again; a row whose window already wrapped,
    or that a round leaves unwrapped, trims. Greedy n-gram rows, alone and beside plain ones,
    write what mlx-lm writes for each prompt alone."""
    family, overrides = WRAPPING_INSIDE_A_ROUND[shape]
    path = build(family, tmp_path / family, forged / "target", seed=1, overrides=overrides)
    model, tokenizer = load_model(str(path))
    assert runs_row_by_row(model)
    ids = tokenizer.encode(code_sample("speculation"))
    batch = [ids[:11], ids[40:52], ids[300:313], ids[120:126] * 2]  # shorter than the window
    expected = [reference(model, tokenizer, p) for p in batch]
    assert staggered(model, tokenizer, batch, NGRAM) == expected, "n-gram speculation changed the output"
    assert staggered(model, tokenizer, batch, [NGRAM, None, NGRAM, None]) == expected, "a mixed batch changed it"


@pytest.mark.parametrize("shape", sorted(WRAPPING_INSIDE_A_ROUND))
def test_a_row_by_row_cache_rolled_back_across_its_window_holds_exactly_the_kept_columns(shape, forged, tmp_path):
    """The cache itself: a provisional forward that wraps the window, three columns rolled back,
    then a one-token step; its logits are those of a cache that only ever saw the kept tokens."""
    family, overrides = WRAPPING_INSIDE_A_ROUND[shape]
    model, _ = load_model(str(build(family, tmp_path / family, forged / "target", seed=1, overrides=overrides)))
    prompt, round_, step = [[5 + i for i in range(12)]], [[40, 41, 42, 43, 44, 45]], [[7]]
    rolled_back = make_row_cache(model, [0])
    rolled_back.forward(model, mx.array(prompt))
    rolled_back.forward(model, mx.array(round_), provisional=True)
    rolled_back.rollback([3])
    kept = make_row_cache(model, [0])
    kept.forward(model, mx.array(prompt))
    kept.forward(model, mx.array([round_[0][:3]]))
    got, want = (cache.forward(model, mx.array(step))[0, -1] for cache in (rolled_back, kept))
    assert mx.allclose(got, want, atol=1e-4).item(), mx.abs(got - want).max().item()


def test_a_family_whose_padding_leaks_into_its_rows_prefills_them_alone(family_models):
    """OLMo Hybrid's short convolutions read the padded columns of a left-padded row, so
    batched prefill would change a padded row's tokens (the parity tests catch that); the
    probe finds it exactly, and a model it flags gets prefill groups of one row."""
    leaking, tokenizer = load_model(str(family_models("olmo_hybrid")))
    clean, _ = load_model(str(family_models("qwen3_next")))  # masks its padding, the same layer kinds
    assert padding_leaks(leaking) and not padding_leaks(clean)

    async def groups(engine):
        sizes = []
        admit = engine.scheduler._admit

        def counted():
            admit()
            if engine.scheduler.prefill is not None and engine.scheduler.prefill.done == 0:
                sizes.append(len(engine.scheduler.prefill.seqs))
        engine.scheduler._admit = counted
        await asyncio.gather(*(generate(engine, [5 + i] * (3 + 4 * i)) for i in range(3)))
        return sizes
    assert set(run_engine(leaking, tokenizer, groups, max_batch_size=4)) == {1}


def test_families_whose_rows_decode_differently_together_run_row_by_row(family_models):
    """Gemma 2 and AFM 7 read positions from the batch's width and gpt_bigcode takes one offset
    for the batch, so two rows decoded together are wrong (or raise); the probe finds them, and
    Gemma 2 served row by row keeps parity with mlx-lm, speculating too."""
    flagged = {f: runs_row_by_row(load_model(str(family_models(f)))[0])
               for f in ("gemma2", "afm7", "gpt_bigcode", "llama", "qwen3_next", "gemma3_text")}
    assert flagged == {"gemma2": True, "afm7": True, "gpt_bigcode": True,
                       "llama": False, "qwen3_next": False, "gemma3_text": False}, flagged
    check_family(family_models("gemma2"))


@pytest.mark.parametrize("family", [f for f in served_families() if f not in FAMILIES])
def test_every_other_family_mlx_lm_ships_batches_exactly_and_speculates_losslessly(family, family_models, forged):
    """Each family outside the hand-written matrix, as a tiny model built from its ModelArgs
    (and its checkpoints' shapes) and loaded with mlx_lm.load: a short prompt left-padded
    beside a longer one gives the logits it gives alone (row by row where the load probe
    found batching inexact; skipped for a family whose padding leaks, which prefills alone),
    and a staggered batch mixing n-gram, no speculation and a draft model (the forge's
    Llama, mostly rejected) gives each row mlx-lm's own greedy tokens, windows wrapping."""
    if family in METAL_ONLY and not mx.metal.is_available():
        pytest.skip(METAL_ONLY[family])
    if family in UNFORGEABLE:
        pytest.skip(UNFORGEABLE[family])
    model, tokenizer = load_model(str(family_models(family)))
    if not padding_leaks(model):
        short, longer = [2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]
        alone = make_row_cache(model, [0]).forward(model, mx.array([short]))[0, -1]
        batched = make_row_cache(model, [3, 0]).forward(model, mx.array([[0] * 3 + short, longer]))[0, -1]
        assert mx.allclose(alone, batched, atol=1e-3, rtol=1e-4).item(), mx.abs(alone - batched).max().item()
    batch = prompts(tokenizer)
    expected = [reference(model, tokenizer, p) for p in batch]
    draft, _ = load_model(str(forged / "draft"))
    assert staggered(model, tokenizer, batch, [NGRAM, None, DRAFT, NGRAM], draft) == expected


def test_every_family_named_is_one_mlx_lm_ships():
    """The matrix follows the installed mlx-lm: the test above runs for every module of
    ``mlx_lm.models`` not listed as not served, and every list names only families that
    mlx-lm still holds, as a module or a model_type it maps onto one (``mistral``), so a
    family mlx-lm drops or renames fails here, not silently."""
    from mlx_lm.utils import MODEL_REMAPPING

    named = set(FAMILIES) | set(NOT_SERVED) | set(METAL_ONLY) | set(UNFORGEABLE) | set(SHAPES)
    known = set(model_types()) | set(MODEL_REMAPPING)
    assert named - known == set(), named - known
    assert set(NOT_SERVED).isdisjoint(served_families()) and len(model_types()) > 100


@pytest.mark.parametrize("family,quantization", QUANTIZED, ids=[f"{f}-{q['mode']}{q['bits']}" for f, q in QUANTIZED])
def test_quantized_family(family, quantization, family_models):
    check_family(family_models(family, quantization=quantization))


@contextmanager
def in_process_daemon(tmp: Path, manifests: str):
    """The daemon (store, control plane, OpenAI and admin routes) on a loopback
    port, in this process, so a test can reach the engines it serves."""
    from aiohttp import web

    from specd.control.plane import ControlPlane
    from specd.serving.registry import ModelRegistry
    from specd.store import Store
    from specd.control.watcher import ManifestDirectory
    from specd.metrics import Metrics
    from specd.daemon import daemon_app

    (tmp / "manifests").mkdir()
    (tmp / "manifests" / "models.yaml").write_text(manifests)
    store = Store(tmp / "specd.db")
    directory = ManifestDirectory(tmp / "manifests", store)
    directory.sync_all()
    control = ControlPlane(store, ModelRegistry(Metrics()), drain_grace=1)
    runner = web.AppRunner(daemon_app(control, directory, drain_grace=1))
    loop = asyncio.new_event_loop()
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", control
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        # the threads that loaded the models must end before the interpreter does (MLX aborts otherwise)
        asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_one_daemon_serves_every_family_and_a_faulting_model_fails_alone(family_models, tmp_path):
    """Every family as a Model of one daemon, each answering a chat
    completion through the openai client, spec off and n-gram; then one
    model's engine faults: its requests get an error (never hang), it is
    Degraded with the reason, the others keep answering, and it recovers."""
    from openai import APIError, OpenAI

    names = {family: family.replace("_", "-") for family in sorted(FAMILIES)}
    # budgets named: by default each would request what 16 rows of its whole window need (tens of them do not fit)
    manifests = "---\n".join(model_manifest(name, family_models(family), kvCache="{maxBytes: 64Mi}",
                                            prefixCache="{maxBytes: 16Mi}") for family, name in names.items())
    with in_process_daemon(tmp_path, manifests) as (url, control):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        models = control.registry.models
        wait_until(lambda: all(m.engine is not None for m in models.values()) and len(models) == len(names))
        messages = [{"role": "user", "content": code_sample("speculation")[:200]}]

        def chat(name: str, spec: bool):
            extra = {"speculation": {"method": "ngram", "num_speculative_tokens": 3}} if spec else None
            return client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0,
                                                  extra_body=extra)
        with ThreadPoolExecutor(8) as pool:
            plain = dict(zip(names.values(), pool.map(lambda n: chat(n, False), names.values())))
            ngram = dict(zip(names.values(), pool.map(lambda n: chat(n, True), names.values())))
        for name in names.values():
            assert plain[name].usage.completion_tokens > 0, name
            assert ngram[name].choices[0].message.content == plain[name].choices[0].message.content, name

        faulty = models["gemma3-text"].engine
        raised = [True]

        def fault(call, *args, **kwargs):
            if raised:
                raise RuntimeError("injected device fault")
            return call(*args, **kwargs)
        hook(faulty.model, fault)
        try:
            with pytest.raises(APIError, match="injected device fault"):  # an error, not the client's timeout
                chat("gemma3-text", False)
            assert chat("qwen3-next", True).choices[0].message.content == plain["qwen3-next"].choices[0].message.content
            degraded = wait_until(lambda: condition(control, "gemma3-text", "Degraded", "True"))
            assert degraded["reason"] == "EngineFault" and "injected device fault" in degraded["message"]
            assert condition(control, "qwen3-next", "Degraded", "False")
            raised.clear()
            recovered = chat("gemma3-text", False).choices[0].message.content
            assert recovered == plain["gemma3-text"].choices[0].message.content
            wait_until(lambda: condition(control, "gemma3-text", "Degraded", "False"))
        finally:
            unhook(faulty.model, fault)


def wait_until(predicate, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def condition(control, model: str, kind: str, status: str) -> dict | None:
    """The Model's ``kind`` condition, if its status is ``status`` (asking for a look at it first)."""
    control.models.look(model)
    obj = control.store.get("Model", model)
    found = next((c for c in obj.status.get("conditions", []) if c["type"] == kind), None)
    return found if found is not None and found["status"] == status else None


def test_limits_come_from_the_text_config(family_models):
    """Vocabulary and context window from each family's own config: nested
    ``text_config`` (Mistral 3, Qwen 3.5, Llama 4, Gemma 3), a YaRN-stretched
    window (Ministral 3), a declared one (the rest)."""
    from mlx_lm import load

    from specd.core.loader import context_window, text_config, vocab_size

    for family, config in FAMILIES.items():
        model, tokenizer = load(str(family_models(family)))
        text = config.get("text_config", config)
        assert vocab_size(model) == text["vocab_size"] == model(mx.array([[0]])).shape[-1], family
        scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
        declared = text.get("max_position_embeddings")
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind == "yarn" and "original_max_position_embeddings" in scaling:
            stretched = int(scaling["original_max_position_embeddings"] * scaling["factor"])
            assert context_window(model, tokenizer) == max(declared or 0, stretched), family
        elif declared and "max_position_embeddings" in text_config(model):
            assert context_window(model, tokenizer) == declared, family


def test_revision_selects_the_hub_snapshot(forged, tmp_path):
    """A Model's ``revision`` picks the snapshot mlx-lm loads from the Hugging
    Face cache (offline here: the same lookup a download resolves through)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--specd--tiny"
    for ref, commit, model in (("main", "a" * 40, "target"), ("small", "b" * 40, "draft")):
        shutil.copytree(forged / model, repo / "snapshots" / commit)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    layers = {name: json.loads((forged / name / "config.json").read_text())["num_hidden_layers"]
              for name in ("target", "draft")}
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    script = ("import sys; from specd.core.loader import load_model; "
              "print(len(load_model('specd/tiny', sys.argv[1] or None)[0].layers))")
    for revision, expected in (("", layers["target"]), ("small", layers["draft"]), ("b" * 40, layers["draft"])):
        out = subprocess.run([sys.executable, "-c", script, revision], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.split()[-1]) == expected, revision


EAGLE_CHAIN = SpeculationConfig("eagle", 3)
EAGLE_TREE = SpeculationConfig("eagle", 3, tree_top_k=3, tree_tokens=8)


@pytest.mark.parametrize("family,version", [("gemma3_text", 1), ("gemma3", 3), ("gpt_oss", 1), ("olmo3", 3),
                                            ("qwen3_next", 1), ("nemotron_h", 3), ("falcon_h1", 1)])
def test_eagle_heads_on_sliding_nested_and_recurrent_families(family, version, family_models, tmp_path):
    """A random EAGLE head (written and loaded as a published checkpoint) on
    targets of other families: chains everywhere, trees where the cache can
    keep one branch (attention only); greedy output stays mlx-lm's."""
    from specd.core.loader import text_config, vocab_size
    from specd.speculation.eagle.checkpoint import load_head, save_head
    from specd.speculation.eagle.head import EagleConfig, EagleHead

    path = family_models(family)
    model, tokenizer = load_model(str(path))
    hidden = text_config(model)["hidden_size"]
    mx.random.seed(0)
    head = EagleHead(EagleConfig(version, hidden, 2 * hidden, 4, 2, vocab_size(model),
                                 feature_layers=(0, 1, 2) if version == 3 else ()))
    save_head(head, tmp_path / "head")
    head = load_head(tmp_path / "head", model)
    batch = prompts(tokenizer)
    expected = [reference(model, tokenizer, p) for p in batch]
    for spec in (EAGLE_CHAIN, EAGLE_TREE):
        assert staggered(model, tokenizer, batch, spec, head) == expected, spec
