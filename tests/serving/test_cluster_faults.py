"""Faults a cluster of Macs meets: a partition that outlasts the head's patience, so a replica
moves while its old copy lives on, and heals; a partition while a worker loads a Model; a lossy,
jittery link (``links.LinkProxy``); a Mac that sleeps for a minute; a head killed mid-stream and
restarted. Placement epochs fence the old copy (``serving/fence.py``); nothing hangs, and the
cluster converges without a restart."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from conftest import code_sample, free_port, model_manifest, start_daemon
from daemons import model_status, wait_for
from specd.core.request import GenerationRequest
from specd.core.sampling import SamplingParams
from specd.serving.fence import EPOCH_HEADER, PlacementFence
from specd.serving.remote import request_to_json
from hub_mirror import HubMirror, hub_env
from links import LinkProxy
from clusters import head, join_token, node_ready, token_file, worker
from test_cluster import BUDGETS, NO_END, chat, node_events, routed

SECRET = "s3cret-cluster-token"
GENERATE = "/apis/specd.dev/v1alpha1/models/m/generate"
HUB_REPO = "specd/tiny"  # the forged target, served by a hub mirror


def served(daemon) -> set[str]:
    """The Models a daemon serves (its own ``/v1/models``)."""
    return {m["id"] for m in json.loads(daemon.get("/v1/models")[1])["data"]}


def call_from_inside(netns_hosts, w, h, epoch: int) -> tuple[int, str]:
    """A call to the worker's replica API from its own side of the link (its namespace), as
    anything still holding the old placement would send it: the token, over TLS, at ``epoch``."""
    body = json.dumps(request_to_json(GenerationRequest("inside", [1, 2, 3], SamplingParams(temperature=0), 4)))
    out = subprocess.run(["ip", "netns", "exec", netns_hosts.ns, "curl", "-s", "--max-time", "20",
                          "--cacert", str(h.state / "tls" / "ca.crt"), "-o", "-", "-w", "\n%{http_code}",
                          "-H", f"Authorization: Bearer {SECRET}", "-H", f"{EPOCH_HEADER}: {epoch}",
                          "-H", "Content-Type: application/json", "-d", body, w.cluster_url + GENERATE],
                         capture_output=True, text=True, timeout=30)
    text, _, code = out.stdout.rpartition("\n")
    return int(code or 0), text


def serving_on(h, node: str) -> None:
    """Wait for Model m's one replica to be placed on ``node`` and to serve there."""
    wait_for(lambda: [r["node"] for r in model_status(h, "m")["replicas"]] == [node], 60, f"the replica on {node}")
    wait_for(lambda: model_status(h, "m").get("readyReplicas") == 1, 120, f"{node}'s replica ready")


def healed(h, w2) -> float:
    """Seconds until w2, its link healed, is Ready again and its copy of m is gone."""
    healed_at = time.monotonic()
    wait_for(lambda: node_ready(h, "w2"), 30, "w2 heard from again")
    wait_for(lambda: "m" not in served(w2), 60, "w2's copy deleted")
    return time.monotonic() - healed_at


def test_a_partition_moves_the_replica_fences_the_old_copy_and_heals_without_a_restart(forged, tmp_path,
                                                                                       netns_hosts):
    """The replica runs on w2, in its own namespace; the link is cut for 30 s. The head counts w2
    NotReady and moves the replica to w1 (a later placement epoch); requests through the head are
    answered, or fail with an error naming the cause, none hangs. Meanwhile w2, not having heard
    from its head for longer than the head waits, refuses a call under its old placement from its
    own side of the link (409 StalePlacement): two replicas never serve one placement. The link
    heals: w2 is Ready again, its old copy is deleted, the replica stays on w1, and the Model's
    status is what was asked, without restarting anything."""
    # no room of its own (every replica goes to a worker), on the link's address for the namespace
    h = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token_file(tmp_path)),
                     "--memory-limit", "1Mi", "--node-name", "head", host=f"{netns_hosts.subnet}.1",
                     admin_token="head-admin-token")
    daemons = [h]
    try:
        daemons.append(w2 := worker(tmp_path, "w2", h, host=f"{netns_hosts.subnet}.2", netns=netns_hosts.ns))
        wait_for(lambda: node_ready(h, "w2"), 30, "w2 joined")
        manifest = yaml.safe_load(model_manifest("m", forged / "target", **BUDGETS))
        assert h.get("/apis/specd.dev/v1alpha1/apply", {"items": [manifest]})[0] == 200
        wait_for(lambda: model_status(h, "m").get("readyReplicas") == 1, 120, "the replica on w2")
        old_epoch = model_status(h, "m")["placementEpoch"]
        daemons.append(worker(tmp_path, "w1", h))
        wait_for(lambda: node_ready(h, "w1"), 30, "w1 joined")
        assert [r["node"] for r in model_status(h, "m")["replicas"]] == ["w2"]
        status, _ = call_from_inside(netns_hosts, w2, h, old_epoch)
        assert status == 200  # the placement is current: the replica serves its head's calls

        text = code_sample("speculation")
        prompts = [[{"role": "user", "content": text[i * 200:i * 200 + 150]}] for i in range(40)]
        outcomes: list[tuple[str, float]] = []

        def ask(messages) -> None:
            started = time.monotonic()
            try:
                chat(h.url, messages, max_tokens=8)
                outcomes.append(("ok", time.monotonic() - started))
            except Exception as err:  # noqa: BLE001: every failure is kept, with its message
                outcomes.append((f"{type(err).__name__}: {err}", time.monotonic() - started))

        cut_at = time.monotonic()
        netns_hosts.cut(True)
        try:
            with ThreadPoolExecutor(2) as pool:
                for messages in prompts:  # steady traffic through the head while the link is down
                    pool.submit(ask, messages)
                    time.sleep(0.5)
                serving_on(h, "w1")
            new_epoch = model_status(h, "m")["placementEpoch"]
            assert new_epoch > old_epoch
            status, answer = call_from_inside(netns_hosts, w2, h, old_epoch)
            assert status == 409 and "StalePlacement" in answer and "not heard from its head" in answer, answer
            time.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))
        finally:
            netns_hosts.cut(False)
        healed_in = healed(h, w2)
        status, answer = call_from_inside(netns_hosts, w2, h, new_epoch)
        assert status == 404, answer  # gone from w2; never served there again

        assert all(seconds < 60 for _, seconds in outcomes), outcomes  # nothing hung
        failures = [o for o, _ in outcomes if o != "ok"]
        print("failures:", failures)
        assert all("w2" in f or "ready" in f.lower() or "503" in f for f in failures), failures
        assert len(outcomes) == len(prompts)
        before = routed(h)
        for messages in prompts[:3]:
            chat(h.url, messages, max_tokens=8)
        after = routed(h)
        assert after["w1"] == before["w1"] + 3 and after.get("w2", 0) == before.get("w2", 0), (before, after)
        final = model_status(h, "m")
        assert [r["node"] for r in final["replicas"]] == ["w1"] and final["readyReplicas"] == 1, final
        assert next(c for c in final["conditions"] if c["type"] == "Ready")["status"] == "True"
        assert any(e["reason"] == "NodeNotReady" for e in node_events(h, "w2"))
        print(f"partition: {len(outcomes)} requests, {len(failures)} failed with a named cause, "
              f"epochs {old_epoch} -> {new_epoch}, converged {healed_in:.1f}s after healing")
    finally:
        for d in daemons:
            d.stop(signal.SIGKILL)


def test_a_partition_during_a_models_load_leaves_one_replica_and_converges(forged, tmp_path, netns_hosts):
    """The link to w2 is cut for 30 s while w2 is still downloading the Model's weights from the hub
    (a Mac cut off mid-load). The head counts w2 NotReady and places the replica on w1, which loads
    and serves it; w2's load, cut off, never serves. Healed, w2 is Ready again, its copy of the
    Model is deleted, the replica stays on w1 and every request goes there: one replica, no
    restart."""
    subnet = netns_hosts.subnet
    mirror = HubMirror({HUB_REPO: forged / "target"}, bytes_per_second=200_000)
    endpoint = mirror.start(host=f"{subnet}.1")  # reachable from the namespace, until the cut

    def hub(name: str) -> dict[str, str]:
        return hub_env(tmp_path / name / "hub", endpoint)
    h = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token_file(tmp_path)),
                     "--memory-limit", "1Mi", "--node-name", "head", host=f"{subnet}.1", env=hub("head"),
                     admin_token="head-admin-token")
    daemons = [h]
    try:
        daemons.append(w2 := worker(tmp_path, "w2", h, host=f"{subnet}.2", netns=netns_hosts.ns, env=hub("w2")))
        wait_for(lambda: node_ready(h, "w2"), 30, "w2 joined")
        manifest = yaml.safe_load(model_manifest("m", HUB_REPO, **BUDGETS))
        assert h.get("/apis/specd.dev/v1alpha1/apply", {"items": [manifest]})[0] == 200
        # the head reads only the weights' header; a megabyte of them is w2's download under way
        wait_for(lambda: mirror.bytes_sent.get("model.safetensors", 0) > 2**20, 60, "w2 downloading the weights")
        mirror.set_rate(1_000)  # the rest of w2's download outlasts w1's start, however busy the cores
        daemons.append(worker(tmp_path, "w1", h, env=hub("w1")))
        wait_for(lambda: node_ready(h, "w1"), 30, "w1 joined")
        assert [r["node"] for r in model_status(h, "m")["replicas"]] == ["w2"]
        assert model_status(h, "m").get("readyReplicas", 0) == 0  # w2 has not loaded it yet

        cut_at = time.monotonic()
        netns_hosts.cut(True)
        mirror.set_rate(None)
        try:
            serving_on(h, "w1")
            assert chat(h.url, [{"role": "user", "content": "def f(x):"}], max_tokens=4).usage.completion_tokens
            time.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))
        finally:
            netns_hosts.cut(False)
        healed_in = healed(h, w2)
        before = routed(h)
        for i in range(3):
            chat(h.url, [{"role": "user", "content": f"def g{i}(x):"}], max_tokens=4)
        after = routed(h)
        assert after["w1"] == before["w1"] + 3 and after.get("w2", 0) == 0, (before, after)
        final = model_status(h, "m")
        assert [(r["node"], r["phase"]) for r in final["replicas"]] == [("w1", "Ready")], final
        assert final["readyReplicas"] == 1 and final["phase"] == "Ready", final
        print(f"partition during a load: placed on w1, w2's copy gone {healed_in:.1f}s after healing")
    finally:
        for d in daemons:
            d.stop(signal.SIGKILL)
        mirror.stop()


def test_the_fence_follows_the_heads_word_and_its_lease():
    """What a worker's replica admits of its head's calls, with a clock the test moves."""
    now = [0.0]
    fence = PlacementFence(6.0, clock=lambda: now[0])
    assert fence.refusal("free", None, None) is None  # a Model no head placed here
    assert "not heard from its head since it started" in fence.refusal("m", 3, 3)
    fence.heard({"epochs": {"m": 3}, "placed": ["m"]})
    assert fence.refusal("m", 3, 3) is None and fence.refusal("m", 3, 4) is None
    assert "older than 3" in fence.refusal("m", 3, 2)
    now[0] = 7.0  # silent past the lease: only a newer epoch (the head moved on, and calls here) runs
    assert "not heard from its head for 7s" in fence.refusal("m", 3, 3)
    assert fence.refusal("m", 3, 4) is None
    fence.heard({"epochs": {"m": 4}, "placed": []})  # moved elsewhere
    assert "on other Nodes at placement epoch 4" in fence.refusal("m", 3, 4)
    assert "on other Nodes" in fence.refusal("m", 3, 9)
    fence.heard({"epochs": {"m": 2}, "placed": []})  # an answer older than the apply fences nothing
    assert fence.refusal("m", 3, 3) is None
    fence.heard({"epochs": {"m": 5}, "placed": ["m"]})  # placed here again, later
    assert fence.refusal("m", 5, 5) is None and "older than 5" in fence.refusal("m", 3, 4)


def test_a_lossy_jittery_link_delays_answers_but_never_changes_or_hangs_them(forged, tmp_path):
    """Both ways between head and worker every chunk is delayed by up to 200 ms of jitter, and one in
    twenty stalls a further second as a lost packet's retransmission does: requests through the
    head get the tokens the worker gives them directly, each within a bound, and the Node stays
    Ready through the heartbeats the link delays."""
    h = head(tmp_path)
    to_head = LinkProxy(h.cluster_port, jitter=0.2, loss=0.05, stall=1.0, seed=1)
    worker_port = free_port()
    to_worker = LinkProxy(worker_port, jitter=0.2, loss=0.05, stall=1.0, seed=2)
    w = start_daemon(tmp_path / "w1", {}, True, "--join", f"https://127.0.0.1:{to_head.port}", "--token-file",
                     str(join_token(h)), "--node-name", "w1", "--memory-limit", "2Gi",
                     "--advertise", f"https://127.0.0.1:{to_worker.port}", cluster_port=worker_port)
    try:
        wait_for(lambda: node_ready(h, "w1"), 60, "w1 joined over the lossy link")
        manifest = yaml.safe_load(model_manifest("m", forged / "target", **BUDGETS))
        assert h.get("/apis/specd.dev/v1alpha1/apply", {"items": [manifest]})[0] == 200
        wait_for(lambda: model_status(h, "m").get("readyReplicas") == 1, 180, "the replica on w1")
        text = code_sample("speculation")
        prompts = [[{"role": "user", "content": text[i * 300:i * 300 + 250]}] for i in range(9)]
        direct = [chat(w.url, p, max_tokens=24).choices[0].message.content for p in prompts]
        started = time.monotonic()
        timings: list[float] = []

        def through_head(messages) -> str:
            began = time.monotonic()
            answer = chat(h.url, messages, max_tokens=24).choices[0].message.content
            timings.append(time.monotonic() - began)
            return answer
        with ThreadPoolExecutor(3) as pool:
            lossy = list(pool.map(through_head, prompts))
        assert lossy == direct
        assert max(timings) < 60, timings
        assert to_head.stalls + to_worker.stalls > 0  # the link did stall
        assert node_ready(h, "w1")
        assert not any(e["reason"] == "NodeNotReady" for e in node_events(h, "w1"))
        print(f"lossy link: {len(prompts)} requests answered as directly in {time.monotonic() - started:.1f}s "
              f"(slowest {max(timings):.1f}s), {to_head.stalls + to_worker.stalls} stalls")
    finally:
        for d in (h, w):
            d.stop(signal.SIGKILL)


def test_a_mac_that_sleeps_for_a_minute_comes_back_ready_its_replicas_kept_or_removed(forged, tmp_path):
    """A worker stopped for 60 s and resumed, as a Mac whose lid closed. Model m fits the other
    worker too, so the head moves it there; Model k (a KV budget only the sleeping Mac has room for)
    stays placed on it. Back, the Mac is Ready again: m's old copy is fenced and deleted, k is the
    same engine, never loaded again, serving again. Every request sent meanwhile through the head
    was answered or failed with a message, none hung."""
    h = head(tmp_path)
    big = worker(tmp_path, "big", h, None, "--memory-limit", "2Gi")
    small = worker(tmp_path, "small", h, None, "--memory-limit", "320Mi")
    daemons = [h, big, small]
    try:
        wait_for(lambda: node_ready(h, "big") and node_ready(h, "small"), 30, "workers joined")
        docs = [yaml.safe_load(model_manifest("m", forged / "target", **BUDGETS)),
                yaml.safe_load(model_manifest("k", forged / "target", kvCache="{maxBytes: 512Mi}",
                                              prefixCache="{maxBytes: 16Mi}"))]
        assert h.get("/apis/specd.dev/v1alpha1/apply", {"items": docs})[0] == 200
        for name in ("m", "k"):
            wait_for(lambda n=name: model_status(h, n).get("readyReplicas") == 1, 120, f"{name} ready")
        placed = {n: [r["node"] for r in model_status(h, n)["replicas"]] for n in ("m", "k")}
        if placed["m"] != ["big"]:  # the head put m beside k only if it had most room there
            assert placed["m"] == ["small"], placed
        assert placed["k"] == ["big"], placed
        big.admin_token, big.trust = SECRET, (h.state / "tls" / "ca.crt").read_bytes()

        def loads_on_big(model: str) -> int:
            events = json.loads(big.get(f"/apis/specd.dev/v1alpha1/models/{model}/events")[1])["items"]
            return sum(e["reason"] == "Loading" for e in events)
        k_loads = loads_on_big("k")
        outcomes: list[tuple[str, str, float]] = []
        stop = False

        def traffic(model: str) -> None:
            i = 0
            while not stop:
                began = time.monotonic()
                try:
                    client = OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                    client.completions.create(model=model, prompt=f"def step_{i}(x):", max_tokens=8, temperature=0)
                    outcomes.append((model, "ok", time.monotonic() - began))
                except Exception as err:  # noqa: BLE001: every failure is kept, with its message
                    status, code = getattr(err, "status_code", None), getattr(err, "code", None)
                    outcomes.append((model, f"{type(err).__name__} {status} {code}: {err}", time.monotonic() - began))
                    time.sleep(0.5)
                i += 1
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(traffic, n) for n in ("m", "k")]
            time.sleep(2)
            big.proc.send_signal(signal.SIGSTOP)
            slept_at = time.monotonic()
            try:
                if placed["m"] == ["big"]:
                    wait_for(lambda: [r["node"] for r in model_status(h, "m")["replicas"]] == ["small"], 50,
                             "m moved to small")
                time.sleep(max(0.0, 60 - (time.monotonic() - slept_at)))
            finally:
                big.proc.send_signal(signal.SIGCONT)
            woke_at = time.monotonic()
            wait_for(lambda: node_ready(h, "big"), 30, "big Ready again")
            wait_for(lambda: model_status(h, "k").get("readyReplicas") == 1, 60, "k serving again on big")
            if placed["m"] == ["big"]:
                wait_for(lambda: "m" not in served(big), 60, "m's old copy deleted from big")
            converged = time.monotonic() - woke_at
            time.sleep(2)
            stop = True
            for future in running:
                future.result()
        assert [r["node"] for r in model_status(h, "k")["replicas"]] == ["big"]
        assert [r["node"] for r in model_status(h, "m")["replicas"]] == ["small"]
        assert loads_on_big("k") == k_loads  # the same engine: kept, not loaded again
        assert all(seconds < 30 for _, _, seconds in outcomes), [o for o in outcomes if o[2] >= 30]
        failures = [o for _, o, _ in outcomes if o != "ok"]
        assert all(("big" in f or "ready" in f.lower() or "replica" in f.lower()) for f in failures), failures
        # a request the sleeping Mac took and never began is a 503 (send it again), not a 500
        assert any(" 503 replica_unreachable: " in f and "Node big" in f for f in failures), failures
        assert sum(o == "ok" for m, o, _ in outcomes if m == "m") > 0
        assert any(o == "ok" for m, o, t in outcomes if m == "k")
        print(f"sleep: {len(outcomes)} requests, {len(failures)} failed with a message, "
              f"converged {converged:.1f}s after waking")
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
            d.stop(signal.SIGKILL)


def test_a_head_killed_mid_stream_fails_the_stream_and_its_restart_adopts_the_workers_replicas(forged, tmp_path):
    """The head is killed (``kill -9``) while it streams a completion a worker generates: the client's
    stream ends with an error at once, not a hang, and the worker cancels the request. The worker
    keeps its replica through the head's absence (it answers directly meanwhile); the restarted head
    adopts it, the same engine, never loaded again, and serves through it."""
    h = head(tmp_path)
    w = worker(tmp_path, "w1", h)
    daemons = [h, w]
    try:
        wait_for(lambda: node_ready(h, "w1"), 30, "w1 joined")
        manifest = yaml.safe_load(model_manifest("m", forged / "target", **BUDGETS))
        assert h.get("/apis/specd.dev/v1alpha1/apply", {"items": [manifest]})[0] == 200
        wait_for(lambda: model_status(h, "m").get("readyReplicas") == 1, 120, "the replica on w1")
        w.admin_token, w.trust = SECRET, (h.state / "tls" / "ca.crt").read_bytes()

        def loads() -> int:
            events = json.loads(w.get("/apis/specd.dev/v1alpha1/models/m/events")[1])["items"]
            return sum(e["reason"] == "Loading" for e in events)

        def running_on_worker() -> float:
            text = w.get("/metrics")[1].decode()
            return sum(s.value for f in text_string_to_metric_families(text) if f.name == "specd_num_requests_running"
                       for s in f.samples if s.labels.get("model_name") == "m")
        loaded = loads()
        client = OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="m", prompt="def f():", max_tokens=1500, stream=True,
                                           logit_bias=NO_END)
        next(iter(stream))
        wait_for(lambda: running_on_worker() == 1, 15, "the stream running on the worker")
        h.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        failed_after = time.monotonic() - killed_at
        assert failed_after < 5, failed_after
        wait_for(lambda: running_on_worker() == 0, 15, "the worker cancelling the request the head left")
        alone = chat(w.url, [{"role": "user", "content": "def g():"}]).choices[0].message.content  # still serving
        h = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token_file(tmp_path)),
                         "--memory-limit", "1Mi", "--node-name", "head", port=h.port, cluster_port=h.cluster_port)
        daemons.append(h)
        wait_for(lambda: node_ready(h, "w1") and model_status(h, "m").get("readyReplicas") == 1, 60,
                 "the restarted head adopting w1's replica")
        assert chat(h.url, [{"role": "user", "content": "def g():"}]).choices[0].message.content == alone
        assert loads() == loaded  # adopted, not loaded again
        print(f"head restart: the stream failed {failed_after:.2f}s after the kill; the replica adopted")
    finally:
        for d in daemons:
            d.stop(signal.SIGKILL)
