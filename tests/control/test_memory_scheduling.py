"""The node's memory, scheduled like a Kubernetes node's, against real daemons:
requests, Unschedulable with the numbers, load on demand, idle unload,
eviction by priority and LRU, retry with backoff, restart after kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from conftest import WIDE_KV, model_manifest, start_daemon
from specd.api.manifest import parse_resource
from specd.core.memory import gib
from specd.engine.resources import ENGINE_OVERHEAD, memory_request, safetensors_bytes
from daemons import get, specd, wait_for

KV = 8 << 20
PREFIX = 4 << 20


def spec_lines(**scaling) -> dict:
    """A Model's fixed budgets (so its request is known) and its scaling."""
    extra = {"kvCache": f"{{maxBytes: {KV}}}", "prefixCache": f"{{maxBytes: {PREFIX}}}"}
    if scaling:
        extra["scaling"] = "{" + ", ".join(f"{k}: {v}" for k, v in scaling.items()) + "}"
    return extra


def request_bytes(forged: Path) -> int:
    doc = {"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": "x"},
           "spec": {"source": str(forged / "target"), "kvCache": {"maxBytes": KV}, "prefixCache": {"maxBytes": PREFIX}}}
    return memory_request(parse_resource(doc).spec, None, 1 << 40).total


def test_resources_memory_holds_the_budgets_it_does_not_name(forged):
    """``resources.memory`` replaces the sum, and the engine, built with the request's budgets,
    stays within it: a KV budget the Model does not name is what the memory leaves after the
    weights, the budgets it names and an engine's overhead; the prefix cache gets the rest."""
    weights = safetensors_bytes(forged / "target")

    def request(**spec):
        doc = {"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": "x"},
               "spec": {"source": str(forged / "target"), **spec}}
        return memory_request(parse_resource(doc).spec, None, 1 << 40)

    leaves = 3 << 20
    memory = weights + ENGINE_OVERHEAD + leaves
    assert request().kv_cache > leaves  # unnamed, the KV budget would hold more than the memory leaves
    tight = request(resources={"memory": memory})
    assert (tight.kv_cache, tight.prefix_cache, tight.total) == (leaves, 0, memory)
    named = request(resources={"memory": memory}, kvCache={"maxBytes": 1 << 20})
    assert (named.kv_cache, named.prefix_cache) == (1 << 20, 1 << 20)  # the prefix default: at most the KV budget
    roomy = request(resources={"memory": 1 << 40})
    assert (roomy.kv_cache, roomy.prefix_cache) == (request().kv_cache, request().prefix_cache)
    parts = weights + ENGINE_OVERHEAD
    assert all(r.weights + r.kv_cache + r.prefix_cache + r.drafter + r.overhead <= r.total == memory
               for r in (tight, named)) and parts < memory


def apply(daemon, text: str, tmp_path: Path) -> str:
    f = tmp_path / "apply.yaml"
    f.write_text(text)
    return specd(daemon, "apply", "-f", str(f)).stderr


def condition(daemon, name: str) -> dict:
    return next(c for c in get(daemon, "model", name)["status"]["conditions"] if c["type"] == "Ready")


def events(daemon, name: str) -> list[dict]:
    return json.loads(daemon.get(f"/apis/specd.dev/v1alpha1/models/{name}/events")[1])["items"]


def node(daemon) -> dict:
    return json.loads(daemon.get("/apis/specd.dev/v1alpha1/nodes")[1])["items"][0]["status"]


def samples(daemon, family: str) -> dict[tuple, float]:
    text = daemon.get("/metrics")[1].decode()
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            if f.name == family for s in f.samples if s.name.endswith(("_total", "_bytes")) or s.name == family}


def chat(daemon, model: str, max_tokens: int = 4) -> str:
    client = OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content


def test_the_request_counts_weights_budgets_and_overhead(forged):
    weights = safetensors_bytes(forged / "target")
    assert request_bytes(forged) == weights + KV + PREFIX + ENGINE_OVERHEAD
    from mlx_lm import load
    from specd.core.loader import weight_bytes

    assert weights == weight_bytes(load(str(forged / "target"))[0])  # the headers say what loading takes


@pytest.fixture()
def two_fit(forged, tmp_path):
    """A daemon whose node holds two of the forged Models (with fixed budgets), not three."""
    limit = int(request_bytes(forged) * 2.5)
    d = start_daemon(tmp_path, {}, True, "--memory-limit", str(limit), "--load-timeout", "120")
    yield d
    d.stop()


def test_a_model_that_does_not_fit_is_unschedulable_until_room_appears(forged, tmp_path, two_fit):
    d, need = two_fit, request_bytes(forged)
    apply(d, "---\n".join(model_manifest(n, forged / "target", **spec_lines()) for n in ("a", "b", "c")), tmp_path)
    wait_for(lambda: sum(condition(d, n)["status"] == "True" for n in "abc") == 2, 120, "two Models ready")
    waiting = next(n for n in "abc" if condition(d, n)["status"] == "False")
    cond = wait_for(lambda: condition(d, waiting)["reason"] == "Unschedulable" and condition(d, waiting), 60,
                    "Unschedulable")
    assert f"needs {gib(need)}" in cond["message"] and "free of" in cond["message"], cond
    assert any(e["reason"] == "Unschedulable" for e in events(d, waiting))
    status = node(d)
    assert status["requested"] == 2 * need and len(status["models"]) == 2
    assert status["allocatable"] == int(need * 2.5)
    table = specd(d, "get", "nodes").stdout
    assert "ALLOCATABLE" in table and status["models"][0]["name"] in table
    assert "Unschedulable" in specd(d, "describe", "model", waiting).stdout

    # more than the node has: refused at apply only for a request below the weights, warned otherwise
    big = model_manifest("big", forged / "target", resources="{memory: 1Ti}")
    warned = apply(d, big, tmp_path)
    assert "Warning:" in warned and "big" in warned and "Unschedulable" in warned
    assert "can never fit" in wait_for(lambda: condition(d, "big")["reason"] == "Unschedulable"
                                       and condition(d, "big")["message"], 30, "big Unschedulable")
    tiny = model_manifest("tiny", forged / "target", resources="{memory: 1Mi}")
    refused = specd(d, "apply", "-f", "-", stdin=tiny, check=False)
    assert refused.returncode != 0 and "spec.resources.memory" in refused.stderr and "weights" in refused.stderr
    assert "1.0 MiB is less than" in refused.stderr and specd(d, "get", "model", "tiny", check=False).returncode
    specd(d, "delete", "model", "big")

    # an edit that cannot fit: warned, Unschedulable, and the old generation keeps serving
    ready_one = next(n for n in "abc" if n != waiting)
    warned = apply(d, model_manifest(ready_one, forged / "target", **spec_lines(), resources="{memory: 1Ti}"),
                   tmp_path)
    assert "Warning:" in warned
    wait_for(lambda: condition(d, ready_one)["reason"] == "Unschedulable", 30, "edit Unschedulable")
    assert condition(d, ready_one)["status"] == "True" and chat(d, ready_one)

    other = next(n for n in "abc" if n not in (waiting, ready_one))
    specd(d, "delete", "model", other)
    wait_for(lambda: condition(d, waiting)["status"] == "True", 120, "the waiting Model loads")
    assert chat(d, waiting)


def test_scale_from_zero_idle_unload_and_eviction(forged, tmp_path, two_fit):
    d = two_fit
    manifests = [model_manifest("low", forged / "target", **spec_lines(minReplicas=0, priority="low")),
                 model_manifest("n1", forged / "target", **spec_lines(minReplicas=0)),
                 model_manifest("n2", forged / "target", **spec_lines(minReplicas=0)),
                 model_manifest("brief", forged / "target", **spec_lines(minReplicas=0, idleSeconds=2))]
    apply(d, "---\n".join(manifests), tmp_path)
    wait_for(lambda: all(get(d, "model", n)["status"].get("phase") == "Idle" for n in ("low", "n1", "n2", "brief")),
             30, "Models at zero")
    listed = json.loads(d.get("/v1/models")[1])["data"]
    assert {m["id"]: m["status"] for m in listed} == {"low": "Idle", "n1": "Idle", "n2": "Idle", "brief": "Idle"}
    assert d.get("/readyz")[0] == 200 and node(d)["requested"] == 0

    # concurrent first requests: one load, every request answered
    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(chat(d, "n1"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 3
    assert sum(e["reason"] == "Loading" for e in events(d, "n1")) == 1
    chat(d, "n2")  # n1 and n2 fill the node

    # eviction: the least recently used among equals
    chat(d, "low")
    assert [e for e in events(d, "n1") if e["reason"] == "Evicted"] and not events_of(d, "n2", "Evicted")
    # then the lowest priority, though n2 was used before it
    chat(d, "n1")
    assert events_of(d, "low", "Evicted") and not events_of(d, "n2", "Evicted")
    evictions = samples(d, "specd_model_unloads")
    assert evictions[(("model_name", "low"), ("reason", "evicted"))] == 1

    # a busy Model is never evicted: with both loaded Models streaming, a third waits for room
    client = OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    streams = [client.chat.completions.create(model=m, messages=[{"role": "user", "content": "go"}],
                                              max_tokens=1500, temperature=0, stream=True,
                                              logit_bias={"0": -100, "2": -100}) for m in ("n1", "n2")]
    for s in streams:
        next(iter(s))
    status, body = post_chat(d, "low")
    assert status == 503 and "Unschedulable" in body["error"]["message"], body
    for s in streams:
        s.close()
    wait_for(lambda: node(d)["models"] and all(m["evictable"] for m in node(d)["models"]), 60, "streams ended")

    # idle unload after idleSeconds, and loaded again by the next request
    chat(d, "brief")
    wait_for(lambda: events_of(d, "brief", "Idle"), 30, "idle unload")
    assert get(d, "model", "brief")["status"]["phase"] == "Idle"
    assert chat(d, "brief")
    loaded = samples(d, "specd_models_loaded")
    assert list(loaded.values()) == [2.0]
    memory = {dict(k)["kind"]: v for k, v in samples(d, "specd_node_memory_bytes").items()}
    assert memory["requested"] == 2 * request_bytes(forged) and memory["allocatable"] > memory["requested"]


def events_of(daemon, name: str, reason: str) -> list[dict]:
    return [e for e in events(daemon, name) if e["reason"] == reason]


def post_chat(daemon, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(daemon.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        assert err.headers.get("Retry-After"), "a 503 says when to retry"
        return err.code, json.loads(err.read())


def test_an_offline_hub_source_backs_off_and_loads_once_its_files_appear(forged, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = start_daemon(tmp_path, {"m.yaml": model_manifest("hubbed", "specd/tiny")}, False)
    try:
        cond = wait_for(lambda: condition(d, "hubbed")["reason"] == "BackOff" and condition(d, "hubbed"), 60,
                        "BackOff")
        assert "next in 10s" in cond["message"]
        assert get(d, "model", "hubbed")["status"]["nextAttemptSeconds"] <= 10
        assert "NotServing" in json.dumps(get(d, "model", "hubbed")["status"]["conditions"])
        repo = hub / "models--specd--tiny"
        shutil.copytree(forged / "target", repo / "snapshots" / ("a" * 40))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("a" * 40)
        wait_for(lambda: condition(d, "hubbed")["status"] == "True", 90, "loaded by the retry")
        assert chat(d, "hubbed")
        specd(d, "rollout", "restart", "model", "hubbed")
        wait_for(lambda: events_of(d, "hubbed", "RestartRequested"), 10, "restart event")
        wait_for(lambda: sum(e["reason"] == "Ready" for e in events(d, "hubbed")) == 2, 60, "reloaded")
    finally:
        d.stop()


def test_kill_9_during_a_load_keeps_desired_state_and_accounting(forged, tmp_path):
    text = model_manifest("kept", forged / "target", **spec_lines())
    d = start_daemon(tmp_path, {}, False, "--memory-limit", "2Gi")
    apply(d, text, tmp_path)
    wait_for(lambda: events_of(d, "kept", "Loading"), 60, "loading")
    d.stop(signal.SIGKILL)
    d = start_daemon(tmp_path, {}, True, "--memory-limit", "2Gi")
    try:
        assert get(d, "model", "kept")["spec"]["kvCache"]["maxBytes"] == KV
        wait_for(lambda: condition(d, "kept")["status"] == "True", 120, "ready after restart")
        status = node(d)
        assert [m["name"] for m in status["models"]] == ["kept"]
        assert status["requested"] == request_bytes(forged)
    finally:
        d.stop()


def test_a_request_waiting_for_a_load_is_kept_alive_or_told_when_to_retry(forged, tmp_path):
    """The Model's config.json is a FIFO: placing it blocks until the test feeds it."""
    slow = tmp_path / "slow"
    shutil.copytree(forged / "target", slow)
    config = (slow / "config.json").read_bytes()
    (slow / "config.json").unlink()
    os.mkfifo(slow / "config.json")
    d = start_daemon(tmp_path, {"m.yaml": model_manifest("slow", slow, scaling="{minReplicas: 0}")}, True,
                     "--load-timeout", "7")
    try:
        status, body = post_chat(d, "slow")
        assert status == 503 and "after 7s" in body["error"]["message"], body

        body = json.dumps({"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                           "stream": True}).encode()
        req = urllib.request.Request(d.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as stream:  # headers come with the first keep-alive
            assert stream.headers["Content-Type"] == "text/event-stream"
            assert stream.readline() == b": waiting for the model to load\n"

            def feed():  # every reader of config.json gets the real content, once
                while True:
                    with open(slow / "config.json", "wb") as f:
                        f.write(config)
                    time.sleep(0.2)

            threading.Thread(target=feed, daemon=True).start()
            events = [line for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3, events
        assert "error" not in events[-2]
    finally:
        d.stop()


def test_mlx_memory_limit_set_tight_answers_503_naming_memory_and_every_model_keeps_serving(forged, tmp_path):
    """``--mlx-memory-limit`` tighter than the Models were placed for (MLX's own limit): a prompt
    whose KV has no room under it is answered 503 with the numbers, at once (nothing of the
    Model's runs to give memory back); the daemon lives on, the same Model serves a short prompt,
    and the other Model serves throughout."""
    from specd.engine.kv_manager import KVManager
    from specd.engine.resources import kv_token_bytes, read_config
    from specd.forge.families import build

    wide = build("llama", tmp_path / "wide", forged / "target", overrides=WIDE_KV)
    rows = KVManager(0, (kv_token_bytes(read_config(wide), None), 0))
    short, long = rows.row_bytes(16), rows.row_bytes(3000)
    assert long - short > 32 << 20
    weights = safetensors_bytes(wide) + safetensors_bytes(forged / "target")
    slack = (long + short) // 2  # beyond the weights and a step's working memory
    manifests = {"wide.yaml": model_manifest("wide", wide, prefixCache="{maxBytes: 0}"),
                 "tiny.yaml": model_manifest("tiny", forged / "target", prefixCache="{maxBytes: 0}")}
    d = start_daemon(tmp_path, manifests, True, "--mlx-memory-limit", str(weights + ENGINE_OVERHEAD + slack))
    try:
        wait_for(lambda: all(condition(d, m)["status"] == "True" for m in ("wide", "tiny")), 120, "both Ready")
        active = samples(d, "specd_mlx_active_memory_bytes")[()]
        assert samples(d, "specd_mlx_memory_limit_bytes")[()] == weights + ENGINE_OVERHEAD + slack
        assert active - weights < slack - short, "more is active beyond the weights than this test leaves room for"
        client = OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        refused = {}

        def long_prompt() -> None:
            try:
                client.completions.create(model="wide", prompt=[(11 * i) % 500 + 3 for i in range(3000)],
                                          max_tokens=4, temperature=0)
            except Exception as err:  # noqa: BLE001 -- what the client raised is asserted below
                refused["error"] = err
        beside = threading.Thread(target=long_prompt)
        beside.start()
        served = [chat(d, "tiny") for _ in range(3)]
        beside.join(120)
        err = refused.get("error")
        assert err is not None and getattr(err, "status_code", None) == 503, repr(err)
        assert err.response.headers.get("Retry-After") == "1"
        body = err.response.json()["error"]
        assert body["code"] == "out_of_memory" and "memory limit" in body["message"], body
        assert all(isinstance(text, str) for text in served)
        assert isinstance(chat(d, "wide"), str)  # a short prompt has room
        failures = samples(d, "specd_request_failure")
        assert failures[(("model_name", "wide"), ("reason", "out_of_memory"))] == 1
        assert d.proc.poll() is None
    finally:
        d.stop()
