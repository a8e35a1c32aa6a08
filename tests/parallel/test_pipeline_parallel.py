"""Pipeline parallelism: Models on a 2-rank ring Topology with ``parallelism:
pipeline``, each rank holding half the layers, against the same checkpoints in
one process of the same daemon. The forged Llama has no ``pipeline()`` in mlx-lm
(split by ``specd.parallel.pipeline``); Ministral 3 has one, and it is used. A
third group, ``parallelism: auto``, times both splits and keeps the faster."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from conftest import model_manifest, start_daemon
from daemons import model_status, topology
from test_tensor_parallel import METHODS, PROMPTS, assert_speculates_as_single, client_for, complete, pairing, wait_ready

from specd.api.manifest import ManifestError, parse_documents
from specd.parallel.pipeline import layer_range
from specd.parallel.shard import load_shard


@pytest.fixture(scope="module")
def pp(forged, family_models, tmp_path_factory):
    ministral = family_models("ministral3")
    docs = [topology("pipe", parallelism="pipeline", stepTimeoutSeconds=30),
            model_manifest("pp", forged / "target", topologyRef="pipe", maxBatchSize=8),
            model_manifest("single", forged / "target", maxBatchSize=8),
            pairing("pp", forged / "draft"), pairing("single", forged / "draft"),
            model_manifest("pp-ministral", ministral, topologyRef="pipe", maxBatchSize=8),
            model_manifest("single-ministral", ministral, maxBatchSize=8),
            topology("timed", parallelism="auto", stepTimeoutSeconds=30),
            model_manifest("pp-auto", forged / "target", topologyRef="timed", maxBatchSize=8),
            pairing("pp-auto", forged / "draft")]
    daemon = start_daemon(tmp_path_factory.mktemp("pp"), {"models.yaml": "---\n".join(docs)})
    yield daemon
    daemon.stop()


def test_layer_ranges_cover_the_stack_once_last_layers_on_rank_0():
    for layers in (2, 5, 6, 61):
        for size in (2, 3, 4):
            if layers < size:
                continue
            ranges = [layer_range(layers, r, size) for r in range(size)]
            assert ranges[0][1] == layers and ranges[-1][0] == 0
            assert sorted(i for start, end in ranges for i in range(start, end)) == list(range(layers))


def test_parallelism_is_tensor_pipeline_or_auto():
    text = topology("bad", parallelism="data")
    with pytest.raises(ManifestError) as err:
        parse_documents(text)
    assert err.value.path == "spec.parallelism" and '"auto"' in str(err.value)
    assert parse_documents(topology("timed", parallelism="auto"))[0].spec.parallelism == "auto"


@pytest.mark.parametrize("model,methods", [("pp", METHODS), ("pp-ministral", ["none", "ngram"])])
def test_pipeline_matches_a_single_process_in_mixed_batches(pp, model, methods):
    """Every prompt with every method at once: the two stages' batches mix plain,
    n-gram and draft rows, and every greedy output is the single process's."""
    wait_ready(pp, model, timeout=180)
    single = model.replace("pp", "single")
    client = client_for(pp)
    status = model_status(pp, model)
    assert [r["rank"] for r in status["group"]["ranks"]] == [0, 1]
    jobs = [(p, m) for p in PROMPTS for m in methods]
    with ThreadPoolExecutor(len(jobs)) as pool:
        staged = list(pool.map(lambda j: complete(client, model, *j), jobs))
    baseline = {p: complete(client, single, p, "none") for p in PROMPTS}
    for (prompt, method), got in zip(jobs, staged):
        assert got == baseline[prompt], (model, prompt, method)


def test_each_stage_holds_part_of_the_weights(pp, forged):
    """The group's weights are each rank's summed: every stage keeps the embedding, final norm
    and head, and only its own layers, so the sum passes the checkpoint by those alone."""
    status = wait_ready(pp, "pp", timeout=180)
    tensors = mx.load(str(forged / "target" / "model.safetensors"))
    whole = sum(v.nbytes for v in tensors.values())
    shared = sum(v.nbytes for k, v in tensors.items() if ".layers." not in k)
    assert status["weightBytes"] == whole + shared


def test_pipeline_speculates_as_a_single_process(pp):
    """n-gram and the replicated draft model speculate, and write what a single process writes."""
    wait_ready(pp, "pp", timeout=180)
    assert_speculates_as_single(client_for(pp), "pp")


def test_auto_keeps_the_split_that_decoded_faster_and_serves_exactly_as_a_single_process(pp):
    """``parallelism: auto`` timed a decode step under each split over the group's own link: the
    group runs the faster, status shows both timings, and its greedy output, with every method
    in one mixed batch, is the single process's."""
    status = wait_ready(pp, "pp-auto", timeout=240)
    group = status["group"]
    timed = group["splitProbe"]["stepMilliseconds"]
    assert set(timed) == {"tensor", "pipeline"} and all(ms > 0 for ms in timed.values()), group
    assert group["parallelism"] == min(timed, key=timed.get) and group["splitProbe"]["refused"] == {}
    client = client_for(pp)
    jobs = [(p, m) for p in PROMPTS for m in METHODS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        split = list(pool.map(lambda j: complete(client, "pp-auto", *j), jobs))
    baseline = {p: complete(client, "single", p, "none") for p in PROMPTS}
    for (prompt, method), got in zip(jobs, split):
        assert got == baseline[prompt], (prompt, method, group["parallelism"])


@pytest.mark.parametrize("family,kept,refused,reason", [
    ("phi3", "pipeline", "tensor", "does not support tensor parallelism"),  # no shard() in mlx-lm
    ("gpt_oss", "tensor", "pipeline", "places layers by index"),  # layer_types, and no pipeline()
])
def test_auto_leaves_out_the_split_a_family_cannot_take_with_its_reason(family_models, family, kept, refused,
                                                                         reason):
    """On a one-rank group (each split loads whole here; which one a family can take is its own):
    ``auto`` times only the split it can load, keeps it, and says why the other was left out."""
    group = mx.distributed.init(strict=False)
    model, _, split = load_shard(str(family_models(family)), None, group, "auto")
    assert split.parallelism == kept and list(split.step_seconds) == [kept] and split.step_seconds[kept] > 0
    assert list(split.refused) == [refused] and reason in split.refused[refused]
    assert split.as_dict()["probe"]["refused"] == split.refused


def test_auto_refuses_a_family_that_takes_neither_split_naming_both_reasons(family_models):
    """Gemma 3 has neither mlx-lm's shard() nor pipeline(), and places its sliding layers by index."""
    with pytest.raises(ValueError) as err:
        load_shard(str(family_models("gemma3_text")), None, mx.distributed.init(strict=False), "auto")
    assert "tensor: " in str(err.value) and "pipeline: " in str(err.value)


def test_a_group_that_cannot_load_says_why_in_the_models_status(family_models, tmp_path):
    """Rank 0 tells the daemon why it could not load its part, so the Model's status names the
    reason (Gemma 3 places its layers by index and has no pipeline()), not only an exit code."""
    docs = [topology("pipe", parallelism="pipeline", stepTimeoutSeconds=30),
            model_manifest("gemma", family_models("gemma3_text"), topologyRef="pipe")]
    daemon = start_daemon(tmp_path, {"models.yaml": "---\n".join(docs)}, wait_ready=False)
    try:
        deadline = time.monotonic() + 120
        while not (ready := next((c for c in model_status(daemon, "gemma").get("conditions", [])
                                  if c["type"] == "Ready"), {})).get("message", "").startswith("RuntimeError"):
            assert time.monotonic() < deadline, model_status(daemon, "gemma")
            time.sleep(0.2)
        assert ready["reason"] == "Restarting"
        assert ready["message"].startswith("RuntimeError: rank 0 (rank0) could not load: ValueError: gemma3_text "
                                           "places layers by index"), ready
        assert ready["message"].endswith("has no pipeline(): nor shard(), so no split can take it")
    finally:
        daemon.stop()
