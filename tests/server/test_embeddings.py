"""``POST /v1/embeddings`` on forged Qwen3-Embedding-shaped checkpoints, through the official client."""

from __future__ import annotations

import base64
import json
import textwrap
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.utils import _get_classes, load_tokenizer

from conftest import model_manifest, start_daemon

TEXTS = ["def add(a, b):\n    return a + b", "x", "import os\nprint(os.getcwd())  # where we are",
         "é ü 中文 🙂 mixed text", "class Stack:\n    def push(self, item):\n        self.items.append(item)"]
LONG = "\n".join(f"value_{i} = compute({i}, key='k{i}')" for i in range(20))  # past prefillStepTokens: chunked


@pytest.fixture(scope="module")
def embedding_models(forged, tmp_path_factory):
    from specd.forge.embedding import build_embedding

    root = tmp_path_factory.mktemp("embedding")
    # "embed" has the weights as Qwen ships Qwen3-Embedding (no model. prefix, no LM head); "embed-mean"
    # as an mlx_lm conversion has them
    return {"embed": build_embedding(root / "last", forged / "target", "lasttoken", seed=1),
            "embed-mean": build_embedding(root / "mean", forged / "target", "mean_tokens", normalize=False, seed=2,
                                          as_shipped=False)}


@pytest.fixture(scope="module")
def embed_daemon(embedding_models, forged, tmp_path_factory):
    pairing = textwrap.dedent("""\
        apiVersion: specd.dev/v1alpha1
        kind: DraftPairing
        metadata:
          name: embed-ngram
        spec:
          targetRef: embed
          method: ngram
        """)
    manifests = [model_manifest("embed", embedding_models["embed"], task="embed", prefillStepTokens=64,
                                maxContext=1024, maxBatchSize=4),
                 model_manifest("embed-mean", embedding_models["embed-mean"], task="embed"),
                 model_manifest("chat", forged / "target"), pairing]
    daemon = start_daemon(tmp_path_factory.mktemp("embed-daemon"), {"models.yaml": "---\n".join(manifests)})
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def embed_client(embed_daemon):
    return openai.OpenAI(base_url=embed_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def decoder_and_tokenizer(model_dir):
    """mlx-lm's decoder for the checkpoint, its weights loaded strictly by hand (either layout)."""
    config = json.loads((model_dir / "config.json").read_text())
    model_class, args_class = _get_classes(config)
    inner = model_class(args_class.from_dict(config)).model
    weights = mx.load(str(model_dir / "model.safetensors"))
    inner.load_weights([(k.removeprefix("model."), v) for k, v in weights.items() if not k.startswith("lm_head.")])
    return inner, load_tokenizer(model_dir)


def direct(model_dir, text: str, pooling: str, normalize: bool) -> np.ndarray:
    """The embedding computed with the model's own modules: token embedding, each decoder
    layer under a causal mask, the final norm; then the checkpoint's pooling."""
    inner, tokenizer = decoder_and_tokenizer(model_dir)
    h = inner.embed_tokens(mx.array([tokenizer.encode(text)]))
    for layer in inner.layers:
        h = layer(h, "causal", None)
    states = np.array(inner.norm(h)[0].astype(mx.float32))
    pooled = states[-1] if pooling == "lasttoken" else states.mean(axis=0)
    return pooled / np.linalg.norm(pooled) if normalize else pooled


@pytest.mark.parametrize("name,pooling,normalize", [("embed", "lasttoken", True), ("embed-mean", "mean_tokens", False)])
def test_embeddings_equal_a_direct_computation_with_the_models_modules(embed_client, embedding_models, name,
                                                                       pooling, normalize):
    out = embed_client.embeddings.create(model=name, input=TEXTS + [LONG], encoding_format="float")
    assert [d.index for d in out.data] == list(range(len(TEXTS) + 1))
    for text, item in zip(TEXTS + [LONG], out.data):
        expected = direct(embedding_models[name], text, pooling, normalize)
        np.testing.assert_allclose(np.array(item.embedding), expected, atol=1e-5)
    if normalize:
        assert all(abs(np.linalg.norm(d.embedding) - 1) < 1e-5 for d in out.data)
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(TEXTS)


def test_batched_and_concurrent_requests_equal_single_ones(embed_client):
    singles = [np.array(embed_client.embeddings.create(model="embed", input=t).data[0].embedding) for t in TEXTS]
    batched = embed_client.embeddings.create(model="embed", input=TEXTS).data
    with ThreadPoolExecutor(len(TEXTS)) as pool:  # several requests share the embedder's forwards
        concurrent = list(pool.map(lambda t: embed_client.embeddings.create(model="embed", input=[t, t]), TEXTS))
    for single, one, pair in zip(singles, batched, concurrent):
        np.testing.assert_allclose(np.array(one.embedding), single, atol=1e-5)
        for item in pair.data:
            np.testing.assert_allclose(np.array(item.embedding), single, atol=1e-5)


def test_token_id_inputs_equal_their_text(embed_client, embedding_models):
    tokenizer = load_tokenizer(embedding_models["embed"])
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_text = embed_client.embeddings.create(model="embed", input=TEXTS[:2]).data
    by_ids = embed_client.embeddings.create(model="embed", input=ids).data
    one = embed_client.embeddings.create(model="embed", input=ids[0]).data
    for a, b in zip(by_text, by_ids):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    np.testing.assert_allclose(one[0].embedding, by_text[0].embedding, atol=1e-6)


def test_dimensions_cut_and_renormalize_and_base64_carries_the_same_floats(embed_daemon, embed_client):
    full = np.array(embed_client.embeddings.create(model="embed", input=TEXTS[0], encoding_format="float")
                    .data[0].embedding)
    cut = np.array(embed_client.embeddings.create(model="embed", input=TEXTS[0], dimensions=16).data[0].embedding)
    assert cut.shape == (16,)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    raw = json.loads(_post(embed_daemon, {"model": "embed", "input": TEXTS[0], "encoding_format": "base64"})[1])
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, full.astype(np.float32))
    unnormalized = np.array(embed_client.embeddings.create(model="embed-mean", input=TEXTS[0], dimensions=8)
                            .data[0].embedding)
    whole = np.array(embed_client.embeddings.create(model="embed-mean", input=TEXTS[0]).data[0].embedding)
    np.testing.assert_allclose(unnormalized, whole[:8], atol=1e-6)  # a checkpoint without Normalize is cut only


def _post(daemon, body: dict) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(daemon.url + "/v1/embeddings", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.parametrize("body,param", [
    ({"model": "chat", "input": "hi"}, "model"),
    ({"model": "embed", "input": []}, "input"),
    ({"model": "embed", "input": [[]]}, "input[0]"),
    ({"model": "embed", "input": ["ok", 5]}, "input[1]"),
    ({"model": "embed", "input": ""}, "input[0]"),
    ({"model": "embed", "input": [[1, 10**9]]}, "input[0]"),
    ({"model": "embed", "input": ["ok", [1] * 5000]}, "input[1]"),
    ({"model": "embed", "input": "hi", "dimensions": 10**6}, "dimensions"),
    ({"model": "embed", "input": "hi", "dimensions": 0}, "dimensions"),
    ({"model": "embed", "input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "embed", "input": "hi", "truncate": True}, "truncate"),
    ({"model": "embed", "input": "\ud800"}, "input"),
])
def test_bad_embedding_requests_are_refused_by_name(embed_daemon, body, param):
    status, raw = _post(embed_daemon, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, (status, error)


def test_an_embedding_model_generates_nothing_and_takes_no_pairing(embed_daemon, embed_client):
    with pytest.raises(openai.BadRequestError) as err:
        embed_client.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model" and "embed" in err.value.body["message"]
    models = {m.id: m for m in embed_client.models.list().data}
    assert models["embed"].task == "embed" and models["chat"].task == "generate"
    model = json.loads(embed_daemon.get("/apis/specd.dev/v1alpha1/models/embed")[1])["status"]
    assert model["embedding"] == {"dimensions": 64, "pooling": "lasttoken", "normalized": True}
    pairing = json.loads(embed_daemon.get("/apis/specd.dev/v1alpha1/draftpairings/embed-ngram")[1])["status"]
    assert pairing["conditions"][0]["reason"] == "TargetServesEmbeddings"


def test_an_unsupported_pooling_fails_the_model_with_the_reason(embedding_models, tmp_path):
    from specd.core.embedding import read_pooling

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Pooling",
                                                      "path": "p"}]))
    (broken / "p").mkdir()
    (broken / "p" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match="weightedmean_tokens"):
        read_pooling(broken)


def test_a_fault_fails_its_batch_and_the_embedder_serves_on(embedding_models):
    """A forward that raises (a weight left lazy on another thread's stream, which the
    embedder thread cannot evaluate) fails the requests of its batch, not later ones."""
    import asyncio

    from specd.core.loader import load_embedding_model
    from specd.engine.embedder import Embedder, EmbeddingFailed

    model, tokenizer, pooling = load_embedding_model(str(embedding_models["embed"]))
    norm = model.model.norm
    weight = norm.weight

    async def go():
        embedder = Embedder("e", model, tokenizer, pooling)
        embedder.start()
        try:
            norm.weight = weight + (mx.zeros((1,)) + 1)
            with pytest.raises(EmbeddingFailed, match="engine error"):
                await asyncio.wait_for(embedder.embed([[1, 2, 3]]), 30)
            fault = embedder.fault
            norm.weight = weight
            vectors = await asyncio.wait_for(embedder.embed([[1, 2, 3], [4]]), 30)
            return fault, embedder.faults, vectors, embedder.fault, embedder.in_flight
        finally:
            await embedder.shutdown(1)

    fault, faults, vectors, recovered, in_flight = asyncio.run(go())
    assert fault is not None and faults == 1 and recovered is None and in_flight == 0
    assert vectors.shape == (2, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
