"""A cluster on loopback: a head and worker daemons that join it with a token, replicas
placed by memory, requests routed by prefix and load, a Node lost and back, a head restarted."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml
from hypothesis import given, settings, strategies as st
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from conftest import code_sample, model_manifest, start_daemon
from specd.serving.cluster import versions
from specd.serving.tls import JoinToken, NodeIdentity, client_context
from specd.control.placement import Candidate, place, place_group, place_remote_groups
from specd.control.reconcilers.model.lifecycle import group_backoff, load_backoff
from specd.core import memory
from specd.core.request import GenerationRequest, Method, SpecStats, SpeculationConfig, StepOutput, TokenLogprob
from specd.core.sampling import SamplingParams
from specd.engine.resources import ENGINE_OVERHEAD
from specd.serving.remote import output_from_json, output_to_json, request_from_json, request_to_json
from clusters import BUDGETS, head, join_token, joined, node_ready, nodes, token_file, worker
from daemons import get, model_status, ready, specd, topology, wait_for

NO_END = {"0": -100, "2": -100}  # the forged tokenizer's end-of-text ids: a sampled reply runs its whole length


def by_node(daemon, sample: str, **labels: str) -> dict[str, float]:
    """A series of the head's ``/metrics`` by Node, of the samples with these labels."""
    text = daemon.get("/metrics")[1].decode()
    return {s.labels["node"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == sample and labels.items() <= s.labels.items()}


def routed(daemon) -> dict[str, float]:
    return by_node(daemon, "specd_routed_requests_total")


def node_events(daemon, name: str) -> list[dict]:
    return json.loads(daemon.get(f"/apis/specd.dev/v1alpha1/nodes/{name}/events")[1])["items"]


def chat(url: str, messages: list[dict], max_tokens: int = 12):
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)


def join(daemon, name: str, token: str, url: str | None = None, **body) -> tuple[int, dict]:
    """A raw join over TLS, trusting the head's CA (or at ``url``)."""
    body = {"address": "https://127.0.0.1:1", "instance": "raw", "versions": versions(),
            "csr": NodeIdentity().signing_request(), **body}
    req = urllib.request.Request(f"{url or daemon.cluster_url}/cluster/v1/nodes/{name}/join",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    context = client_context((daemon.state / "tls" / "ca.crt").read_bytes())
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture()
def cluster(tmp_path):
    with joined(tmp_path) as (h, workers):
        yield h, workers


def test_joins_are_refused_with_the_reason(tmp_path, cluster):
    h, _ = cluster
    status, body = join(h, "w3", "wrong-token")
    assert status == 401 and body["reason"] == "Unauthorized"
    status, body = join(h, "w3", "s3cret-cluster-token", versions={"specd": "0.0.1", "mlx": "0.1"})
    assert status == 422 and "0.0.1" in body["message"]
    status, body = join(h, "w2", "s3cret-cluster-token")  # a live Node holds the name
    assert status == 409 and body["reason"] == "NameInUse"
    assert [e["reason"] for e in node_events(h, "w3")] == ["Unauthorized", "VersionMismatch"]
    assert node_events(h, "w2")[-1]["reason"] == "NameInUse"
    wrong = tmp_path / "wrong-join-token"
    wrong.write_text(str(JoinToken(JoinToken.parse(join_token(h).read_text()).ca_hash, "not-the-token")))
    stray = worker(tmp_path, "w9", h, wrong)
    try:
        wait_for(lambda: any(e["reason"] == "Unauthorized" for e in node_events(h, "w9")), 30, "refusal event")
        assert "w9" not in nodes(h)
        table = specd(h, "get", "nodes").stdout
        assert "w1" in table and "w2" in table and "head" in table
    finally:
        stray.stop(signal.SIGKILL)


def test_a_model_a_head_cannot_read_waits_its_backoff(tmp_path):
    """A head reads each Model's memory request before it places the replicas. A source that is
    not there fails that read, which then waits its backoff as a failed load does (it was read
    again at once: hundreds of thousands of failures in minutes, until the backoff overflowed)."""
    h = head(tmp_path)
    try:
        (tmp_path / "gone.yaml").write_text(model_manifest("gone", tmp_path / "no-such-model", **BUDGETS))
        specd(h, "apply", "-f", str(tmp_path / "gone.yaml"))

        def backoffs() -> list[dict]:
            items = json.loads(h.get("/apis/specd.dev/v1alpha1/models/gone/events")[1])["items"]
            return [e for e in items if e["reason"] == "BackOff"]
        wait_for(backoffs, 30, "the first failed read")
        time.sleep(3)  # a read again at once fails within milliseconds
        assert len(backoffs()) == 1
        ready = next(c for c in get(h, "model", "gone")["status"]["conditions"] if c["type"] == "Ready")
        assert "does not exist (attempt 1; next in 10s)" in ready["message"]
    finally:
        h.stop()
    assert [load_backoff(n) for n in (1, 2, 6, 5000)] == [10, 20, 300, 300]
    assert [group_backoff(n) for n in (1, 5, 6, 5000)] == [1, 16, 30, 30]


def test_a_replica_at_zero_is_woken_by_a_request(forged, tmp_path, cluster):
    """``minReplicas: 0`` on a worker: never loaded, a request through the head loads it and is
    answered; unloaded when idle, the next request wakes it again."""
    h, workers = cluster
    (tmp_path / "z.yaml").write_text(model_manifest("m", forged / "target", **BUDGETS).rstrip("\n")
                                     + "\n  scaling: {minReplicas: 0, idleSeconds: 1}\n")
    specd(h, "apply", "-f", str(tmp_path / "z.yaml"))

    def worker_phase() -> str | None:
        placed = get(h, "model", "m")["status"].get("replicas") or [{}]
        worker = workers.get(placed[0].get("node"))
        status, body = worker.get("/v1/models/m") if worker else (404, b"")  # its admin API is the head's alone
        return json.loads(body).get("status") if status == 200 else None
    for _ in range(2):
        wait_for(lambda: worker_phase() == "Idle", 60, "the replica at zero")
        assert chat(h.url, [{"role": "user", "content": "def f():"}]).usage.completion_tokens > 0


def test_replicas_spread_route_by_prefix_and_survive_a_lost_node(forged, tmp_path, cluster):
    h, workers = cluster
    manifest = model_manifest("m", forged / "target", replicas=2, **BUDGETS)
    (tmp_path / "m.yaml").write_text(manifest)
    specd(h, "apply", "-f", str(tmp_path / "m.yaml"))
    wait_for(lambda: get(h, "model", "m")["status"].get("readyReplicas") == 2, 120, "two replicas")
    assert sorted((r["node"], r["phase"]) for r in get(h, "model", "m")["status"]["replicas"]) == [
        ("w1", "Ready"), ("w2", "Ready")]

    # requests spread over both replicas, each answer what one engine gives
    text = code_sample("speculation")
    prompts = [[{"role": "user", "content": text[i * 300:i * 300 + 200]}] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: chat(h.url, p), prompts))
    alone = [chat(workers["w1"].url, p).choices[0].message.content for p in prompts]
    assert [a.choices[0].message.content for a in answers] == alone
    spread = routed(h)
    assert spread.get("w1", 0) >= 1 and spread.get("w2", 0) >= 1, spread
    # the head's /metrics has each replica's tokens, as the clients' usage counts them
    for kind, field in (("generation", "completion_tokens"), ("prompt", "prompt_tokens")):
        per_node = by_node(h, "specd_replica_tokens_total", kind=kind)
        assert sum(per_node.values()) == sum(getattr(a.usage, field) for a in answers), (kind, per_node)
        assert per_node["w1"] > 0 and per_node["w2"] > 0, (kind, per_node)
    assert set(by_node(h, "specd_replica_requests_running").values()) == {0}

    # a conversation stays with the replica that holds its prefix
    conversation = [{"role": "system", "content": text[:1500]}, {"role": "user", "content": "def f():"}]
    before = routed(h)
    first = chat(h.url, conversation)
    home = next(n for n, v in routed(h).items() if v > before.get(n, 0))
    for turn in range(3):
        conversation += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": f"and then {turn}"}]
        before = routed(h)
        first = chat(h.url, conversation)
        after = routed(h)
        assert after[home] == before[home] + 1, (home, before, after)
        assert first.usage.prompt_tokens_details.cached_tokens > 0
    assert by_node(h, "specd_replica_tokens_total", kind="cached")[home] > 0

    # the Node of that replica hangs mid-stream (its connections stay open): once it is NotReady the
    # stream ends with an error, and traffic moves
    client = OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="m", messages=conversation, max_tokens=1500, temperature=0,
                                            stream=True, logit_bias=NO_END)
    next(iter(stream))
    workers[home].proc.send_signal(signal.SIGSTOP)
    with pytest.raises(openai.APIError, match="NotReady"):
        for _ in stream:
            pass
    assert by_node(h, "specd_replica_failed_requests_total")[home] == 1
    other = "w2" if home == "w1" else "w1"
    assert not node_ready(h, home)
    workers[home].stop(signal.SIGKILL)
    status = wait_for(lambda: (s := get(h, "model", "m")["status"]) and s["readyReplicas"] == 1 and s, 30,
                      "one replica left")
    scheduled = next(c for c in status["conditions"] if c["type"] == "Scheduled")
    assert scheduled["status"] == "False" and f"NotReady: {home}" in scheduled["message"], scheduled
    # no Ready Node has room for it: the replica waits on its Node, its phase Unknown
    assert sorted((r["node"], r["phase"]) for r in status["replicas"]) == sorted([(home, "Unknown"), (other, "Ready")])
    # nothing moved (no Node had room), so no event says it did
    events = json.loads(h.get("/apis/specd.dev/v1alpha1/models/m/events")[1])["items"]
    assert [e for e in events if e["reason"] == "Rescheduled"] == [], events
    # the lost Node is listed NotReady, without the Models and memory its last report claimed
    lost = get(h, "node", home)["status"]
    assert lost["conditions"][0]["status"] == "False" and not {"models", "requested", "inUse"} & set(lost), lost
    before = routed(h)
    for p in prompts[:4]:
        chat(h.url, p)
    after = routed(h)
    assert after[other] == before[other] + 4 and after.get(home, 0) == before.get(home, 0)

    # the head is killed and restarted: its Nodes and the placement are intact
    h.stop(signal.SIGKILL)
    h2 = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token_file(tmp_path)),
                      "--memory-limit", "1Mi", "--node-name", "head", port=h.port, cluster_port=h.cluster_port)
    try:
        assert {"w1", "w2"} <= set(nodes(h2))
        assert sorted(r["node"] for r in get(h2, "model", "m")["status"]["replicas"]) == sorted([home, other])
        wait_for(lambda: node_ready(h2, other), 30, "the live worker heard from again")
        assert chat(h2.url, prompts[0]).choices[0].message.content == alone[0]

        # the lost Node comes back and is reconciled: the replica goes back on it
        workers[home] = worker(tmp_path, home, h2)
        wait_for(lambda: get(h2, "model", "m")["status"].get("readyReplicas") == 2, 120, "two replicas again")
    finally:
        h2.stop(signal.SIGKILL)


def test_every_api_reaches_a_replica_on_another_node_as_that_node_answers(forged, tmp_path, cluster):
    """The head tokenizes and checks each request and hands it to the worker's engine
    (``RemoteEngine``): chat, completions with logprobs, Anthropic's Messages streamed, Responses
    continued by ``previous_response_id`` (stored on the head) and embeddings come back as the
    worker itself answers them; a prompt too long for the worker's context is refused by the head
    with the worker's numbers; a client that leaves cancels its request on the worker."""
    import anthropic
    from specd.forge.embedding import build_embedding

    h, workers = cluster
    embedder = build_embedding(tmp_path / "embed", forged / "target", "lasttoken", seed=1)
    (tmp_path / "m.yaml").write_text(model_manifest("m", forged / "target", **BUDGETS) + "---\n"
                                     + model_manifest("e", embedder, task="embed"))
    specd(h, "apply", "-f", str(tmp_path / "m.yaml"))
    for name in ("m", "e"):
        wait_for(lambda: get(h, "model", name)["status"].get("readyReplicas") == 1, 120, f"{name}'s replica")
    node = get(h, "model", "m")["status"]["replicas"][0]["node"]
    there = workers[node]
    via_head, direct = (OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                        for d in (h, there))
    messages = [{"role": "user", "content": code_sample("speculation")[:300]}]
    assert chat(h.url, messages).choices[0].message.content == chat(there.url, messages).choices[0].message.content

    def logprobs(client):
        out = client.completions.create(model="m", prompt="def f(x):", max_tokens=6, temperature=0, logprobs=2)
        return out.choices[0].text, out.choices[0].logprobs.top_logprobs, out.usage.completion_tokens
    logprobs(direct)  # the prompt in the worker's prefix cache: both answers below start from it
    assert logprobs(via_head) == logprobs(direct)

    def streamed(url: str) -> str:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        with client.messages.stream(model="m", max_tokens=8, messages=messages, extra_body={"temperature": 0}) as stream:
            return "".join(stream.text_stream)
    assert streamed(h.url) == streamed(there.url)

    first = via_head.responses.create(model="m", input="def f():", max_output_tokens=6, temperature=0)
    second = via_head.responses.create(model="m", input="and g", previous_response_id=first.id,
                                       max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn's input and output came along

    inputs = ["def f(x): return x", "class Stack:"]
    embeds_there = OpenAI(base_url=workers[get(h, "model", "e")["status"]["replicas"][0]["node"]].url + "/v1",
                          api_key="unused", max_retries=0, timeout=120)
    vectors = [[d.embedding for d in c.embeddings.create(model="e", input=inputs).data]
               for c in (via_head, embeds_there)]
    assert vectors[0] == vectors[1] and len(vectors[0][0]) > 0

    # the Model's DraftPairing goes with it to the worker, whose replica then speculates
    (tmp_path / "p.yaml").write_text("apiVersion: specd.dev/v1alpha1\nkind: DraftPairing\nmetadata: {name: m-ngram}\n"
                                     "spec: {targetRef: m, method: ngram, numSpeculativeTokens: 3}\n")
    specd(h, "apply", "-f", str(tmp_path / "p.yaml"))

    def speculation() -> dict | None:
        reply = via_head.completions.create(model="m", prompt=code_sample("speculation")[:400], max_tokens=24,
                                            temperature=0)
        return getattr(reply.usage, "speculation", None)
    spec = wait_for(speculation, 60, "the worker's replica speculating with the head's pairing")
    assert spec["method"] == "ngram" and spec["source"] == "model", spec

    # so does the SpecPolicy that selects it: off, the replica decodes plainly; deleted, it speculates again
    (tmp_path / "plain.yaml").write_text("apiVersion: specd.dev/v1alpha1\nkind: SpecPolicy\nmetadata: {name: plain}\n"
                                       "spec: {selector: {matchLabels: {}}, enabled: false}\n")
    specd(h, "apply", "-f", str(tmp_path / "plain.yaml"))
    wait_for(lambda: get(h, "specpolicy", "plain")["status"].get("appliedModels") == ["m"], 30,
             "the head's policy running on the worker's replica")
    wait_for(lambda: get(h, "model", "m")["status"]["replicas"][0].get("specPolicy") == "plain", 15,
             "the worker reporting its replica's policy")
    spec = speculation()
    assert spec["draft_tokens"] == 0 and spec["plain_steps"] > 0, spec
    specd(h, "delete", "specpolicy", "plain")
    wait_for(lambda: (speculation() or {}).get("draft_tokens"), 30, "the worker's replica speculating again")
    wait_for(lambda: "specPolicy" not in get(h, "model", "m")["status"]["replicas"][0], 15,
             "the worker reporting its replica without the policy")

    refusals = []
    for client in (direct, via_head):  # the head checks against the worker's window (under its KV budget)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="m", prompt="x " * 20000, max_tokens=4)
        refusals.append(re.search(r"context window is \d+ tokens", refused.value.message).group())
    assert refusals[0] == refusals[1]

    stream = via_head.completions.create(model="m", prompt="def f():", max_tokens=1500, stream=True,
                                         logit_bias=NO_END)
    next(iter(stream))

    def running() -> float:
        text = there.get("/metrics")[1].decode()
        return sum(s.value for f in text_string_to_metric_families(text) if f.name == "specd_num_requests_running"
                   for s in f.samples if s.labels.get("model_name") == "m")
    wait_for(lambda: running() == 1, 15, "the stream running on the worker")
    stream.response.close()
    wait_for(lambda: running() == 0, 15, "the worker cancelling the request its client left")

    def generate_on_worker(url: str, body: bytes, token: str | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        req = urllib.request.Request(f"{url}/apis/specd.dev/v1alpha1/models/m/generate", body, headers)
        context = client_context((h.state / "tls" / "ca.crt").read_bytes()) if url.startswith("https") else None
        try:
            with urllib.request.urlopen(req, timeout=10, context=context) as r:
                return r.status, {}
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
    request = b'{"prompt_tokens": [1]}'
    assert generate_on_worker(there.cluster_url, request, None)[0] == 401  # only the head, with the token
    status, body = generate_on_worker(there.url, request, "s3cret-cluster-token")
    assert status == 403 and "over TLS" in body["message"], body  # and never in clear text
    status, body = generate_on_worker(there.cluster_url, request, "s3cret-cluster-token")
    assert status == 400 and "not a generation request" in body["message"], body


def test_a_model_too_big_for_any_node_runs_as_a_group_and_moves_when_a_node_is_lost(forged, tmp_path):
    """Nodes of 352, 352 and 380 MiB; a Model that asks 385 MiB fits none (Unschedulable, with the
    numbers). On a Topology of two ranks over the head, w1 and w2 each rank asks half the weights
    and budgets plus an engine's overhead (321 MiB): rank 0's share is held on the head, rank 1
    goes to the Node with the most room (w2), which the head reserves it on. When w2 is lost the
    group fails at once, naming the Node, and starts again with rank 1 on w1."""
    token = token_file(tmp_path)
    h = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token), "--memory-limit", "352Mi",
                     "--node-name", "head")
    workers = {name: worker(tmp_path, name, h, None, "--memory-limit", limit)
               for name, limit in (("w1", "352Mi"), ("w2", "380Mi"))}
    budgets = {"kvCache": "{maxBytes: 64Mi}", "prefixCache": "{maxBytes: 64Mi}"}
    share = -(-1116416 // 2) + 32 * 2**20 + 32 * 2**20 + ENGINE_OVERHEAD  # weights 1,116,416, budgets, overhead
    client = OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def held_on(node: str) -> dict[str, int]:
        return {m["name"]: m["requested"] for m in nodes(h)[node]["status"].get("models", [])}
    try:
        wait_for(lambda: node_ready(h, "w1") and node_ready(h, "w2"), 30, "workers joined")
        (tmp_path / "whole.yaml").write_text(model_manifest("whole", forged / "target", **budgets))
        specd(h, "apply", "-f", str(tmp_path / "whole.yaml"))
        refused = wait_for(lambda: next((c for c in get(h, "model", "whole")["status"].get("conditions", [])
                                         if c["type"] == "Scheduled"), None), 60, "the whole Model refused")
        whole = 1116416 + 64 * 2**20 + 64 * 2**20 + ENGINE_OVERHEAD
        assert refused["reason"] == "Unschedulable" and f"each needs {memory.gib(whole)}" in refused["message"], refused
        specd(h, "delete", "model", "whole")

        (tmp_path / "split.yaml").write_text(topology("pool", ("head", "w1", "w2"), tensorParallelSize=2) + "---\n"
                                             + model_manifest("split", forged / "target", topologyRef="pool", **budgets))
        specd(h, "apply", "-f", str(tmp_path / "split.yaml"))
        wait_for(lambda: ready(h, "model", "split"), 120, "the group serving")
        status = get(h, "model", "split")["status"]
        assert status["group"]["memory"] == {"head": share, "w2": share}
        assert status["resources"]["requests"]["memory"] == share
        wait_for(lambda: held_on("w2").get("split ranks") == share, 30, "w2 counting rank 1's share")
        assert nodes(h)["w2"]["status"]["free"] == 380 * 2**20 - share
        # sampled (no temperature), so end-of-text is barred as in the stream below
        assert client.completions.create(model="split", prompt="def f():", max_tokens=4,
                                         logit_bias=NO_END).usage.completion_tokens == 4

        # w2 is lost mid-stream, its daemon and the rank it runs (every host is this machine here, so
        # the rank is a process the head started, as its status reports): the stream ends with an
        # error naming it, and rank 1 moves to w1
        stream = client.completions.create(model="split", prompt="def f():", max_tokens=1500, stream=True,
                                           logit_bias=NO_END)
        next(iter(stream))
        lost = [r["pid"] for r in get(h, "model", "split")["status"]["group"]["ranks"] if r["host"] == "w2"]
        assert len(lost) == 1, lost
        workers["w2"].proc.send_signal(signal.SIGSTOP)
        os.killpg(lost[0], signal.SIGSTOP)  # a rank leads a process group of its own
        with pytest.raises(openai.APIError, match="Node w2 is NotReady"):
            for _ in stream:
                pass
        wait_for(lambda: ready(h, "model", "split") and get(h, "model", "split")["status"]["group"]["memory"]
                 == {"head": share, "w1": share}, 120, "the group again, on w1")
        wait_for(lambda: held_on("w1").get("split ranks") == share, 30, "w1 counting rank 1's share")
        assert client.completions.create(model="split", prompt="def f():", max_tokens=4,
                                         logit_bias=NO_END).usage.completion_tokens == 4
        specd(h, "delete", "model", "split")
        wait_for(lambda: "split ranks" not in held_on("w1"), 30, "w1's share given back")
    finally:
        for d in (h, *workers.values()):
            d.stop(signal.SIGKILL)


def test_a_group_models_replicas_are_groups_each_with_rank_0_on_its_own_node(forged, tmp_path):
    """A Model of two-rank groups with ``replicas: 2`` on a Topology of four hosts: one group runs
    beside the head, the other has rank 0 on worker w1, which the head applied the Model to with a
    Topology of that group's hosts, so w1 starts the group as its own. The head routes between them
    (both answer as w1's group does); deleting the Model deletes w1's group and its Topology."""
    token = token_file(tmp_path)
    h = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token), "--memory-limit", "1Gi",
                     "--node-name", "head")
    w1 = worker(tmp_path, "w1", h, None, "--memory-limit", "1Gi")
    try:
        wait_for(lambda: node_ready(h, "w1"), 30, "w1 joined")
        (tmp_path / "groups.yaml").write_text(
            topology("pool", ("head", "w1", "spare1", "spare2"), tensorParallelSize=2) + "---\n"
            + model_manifest("split", forged / "target", topologyRef="pool", replicas=2, **BUDGETS))
        specd(h, "apply", "-f", str(tmp_path / "groups.yaml"))
        wait_for(lambda: get(h, "model", "split")["status"].get("readyReplicas") == 2, 180, "both groups serving")
        table = specd(h, "get", "models", "-o", "wide").stdout.splitlines()
        assert table[0].split()[-2:] == ["REPLICAS", "AGE"] and table[1].split()[-2] == "2/2", table
        assert get(h, "model", "split")["status"]["replicas"] == [
            {"node": "head", "ready": True, "phase": "Ready", "hosts": ["head", "spare2"]},
            {"node": "w1", "ready": True, "phase": "Ready", "hosts": ["w1", "spare1"]}]
        # a worker's control plane answers its head only: the token, over TLS
        w1.admin_token, w1.trust = "s3cret-cluster-token", (h.state / "tls" / "ca.crt").read_bytes()

        def on_w1(path: str) -> tuple[int, dict]:
            status, body = w1.get(f"/apis/specd.dev/v1alpha1/{path}")
            return status, json.loads(body)
        group = on_w1("models/split")[1]["status"]["group"]
        assert [r["host"] for r in group["ranks"]] == ["w1", "spare1"], group

        prompts = [f"def {name}(x):" for name in ("parse", "render", "merge", "split", "scan", "fold")]
        via_head, direct = (OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                            for d in (h, w1))

        def complete(client: OpenAI, prompt: str) -> str:
            return client.completions.create(model="split", prompt=prompt, max_tokens=8,
                                             temperature=0).choices[0].text
        with ThreadPoolExecutor(len(prompts)) as pool:
            through_head = list(pool.map(lambda p: complete(via_head, p), prompts))
        assert through_head == [complete(direct, p) for p in prompts]
        assert set(routed(h)) == {"head", "w1"}, routed(h)

        # the head is killed and restarted: its own group starts again, w1's keeps running
        h.stop(signal.SIGKILL)
        h = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token),
                         "--memory-limit", "1Gi", "--node-name", "head", port=h.port, cluster_port=h.cluster_port)
        wait_for(lambda: get(h, "model", "split")["status"].get("readyReplicas") == 2, 180, "both groups again")
        assert on_w1("models/split")[1]["status"]["group"]["ranks"] == group["ranks"]  # the same processes
        assert complete(OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120),
                        prompts[0]) == through_head[0]

        specd(h, "delete", "model", "split")
        wait_for(lambda: on_w1("models/split")[0] == on_w1("topologies/split")[0] == 404, 60,
                 "w1's group and its Topology deleted")
    finally:
        for d in (h, w1):
            d.stop(signal.SIGKILL)


def test_a_worker_on_another_host_serves_is_cut_off_and_comes_back(forged, tmp_path, netns_hosts):
    """Two hosts: the head and worker w1 here, worker w2 in its own network namespace, joined over
    a veth link with the token. Their replicas answer through the head as one engine does. The
    link is cut: w2 is NotReady, and every request goes to w1. The link is back: w2 is Ready
    again and its replica serves again."""
    token = token_file(tmp_path)
    h = start_daemon(tmp_path / "head", {}, True, "--cluster-token-file", str(token), "--memory-limit", "1Mi",
                     "--node-name", "head", host=f"{netns_hosts.subnet}.1", admin_token="head-admin-token")
    daemons = [h]
    try:
        daemons.append(w1 := worker(tmp_path, "w1", h))
        daemons.append(w2 := worker(tmp_path, "w2", h, host=f"{netns_hosts.subnet}.2", netns=netns_hosts.ns))
        wait_for(lambda: node_ready(h, "w1") and node_ready(h, "w2"), 30, "workers joined")
        assert nodes(h)["w2"]["spec"]["address"] == w2.cluster_url
        manifest = yaml.safe_load(model_manifest("m", forged / "target", replicas=2, **BUDGETS))
        assert h.get("/apis/specd.dev/v1alpha1/apply", {"items": [manifest]})[0] == 200
        wait_for(lambda: model_status(h, "m").get("readyReplicas") == 2, 120, "two replicas")

        text = code_sample("speculation")
        prompts = [[{"role": "user", "content": text[i * 300:i * 300 + 200]}] for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            through_head = list(pool.map(lambda p: chat(h.url, p).choices[0].message.content, prompts))
        alone = [chat(w1.url, p).choices[0].message.content for p in prompts]
        assert through_head == alone
        assert routed(h).get("w2", 0) >= 1, routed(h)

        netns_hosts.cut(True)
        try:
            wait_for(lambda: not node_ready(h, "w2"), 30, "w2 NotReady")
            wait_for(lambda: model_status(h, "m").get("readyReplicas") == 1, 30, "one replica left")
            before = routed(h)
            assert [chat(h.url, p).choices[0].message.content for p in prompts[:3]] == alone[:3]
            after = routed(h)
            assert after["w1"] == before["w1"] + 3 and after["w2"] == before["w2"], (before, after)
            assert any(e["reason"] == "NodeNotReady" for e in node_events(h, "w2"))
        finally:
            netns_hosts.cut(False)
        wait_for(lambda: node_ready(h, "w2"), 30, "w2 heard from again")
        wait_for(lambda: model_status(h, "m").get("readyReplicas") == 2, 60, "two replicas again")
        assert sorted(r["node"] for r in model_status(h, "m")["replicas"]) == ["w1", "w2"]
    finally:
        for d in daemons:
            d.stop(signal.SIGKILL)


def test_unschedulable_replicas_name_the_constraint_that_failed():
    """Each message names what left replicas without a Node, with the numbers: one replica per
    Node (every Ready Node runs one already), memory, and the Nodes that are NotReady (a replica
    placed on one waits there while no Ready Node has room for it)."""
    gib = 1 << 30
    two = [Candidate("head", 5 * gib, True), Candidate("w1", 5 * gib, True)]
    assert place(3, gib // 2, ["head", "w1"], two) == (
        ["head", "w1"], "1 of 3 replicas fit no Node: one replica per Node, and each of the 2 Ready Node(s) runs one")
    small = two + [Candidate("w2", gib // 8, True)]
    assert place(3, gib // 2, ["head", "w1"], small)[1] == (
        "1 of 3 replicas fit no Node: each needs 0.5 GiB; the most a Ready Node without one has free is 128.0 MiB")
    down = [Candidate("head", 5 * gib, True), Candidate("w1", 5 * gib, False)]
    assert place(3, gib // 2, ["head"], down) == (
        ["head"], "2 of 3 replicas fit no Node: one replica per Node, and each of the 1 Ready Node(s) runs one; "
        "NotReady: w1")
    # a replica on a NotReady Node that no Ready Node has room for waits there (the Mac may be asleep) ...
    assert place(2, gib // 2, ["head", "w1"], down) == (
        ["head", "w1"], "1 of 2 replicas wait for their NotReady Node, no Ready Node having room for them: "
        "one replica per Node, and each of the 1 Ready Node(s) runs one; NotReady: w1")
    # ... and moves as soon as one has
    assert place(2, gib // 2, ["head", "w1"], down + [Candidate("w2", gib, True)]) == (["head", "w2"], "")


def test_a_group_s_ranks_go_to_its_nodes_with_room_first():
    mib = 2**20
    nodes = [Candidate("a", 100 * mib, True), Candidate("b", 300 * mib, True), Candidate("c", 500 * mib, False),
             Candidate("d", 50 * mib, True)]
    assert place_group(["a", "b", "c", "d", "x"], 2, 100 * mib, nodes) == (["b", "a"], "")  # most free first
    assert place_group(["x", "a", "y"], 3, 100 * mib, nodes) == (["a", "x", "y"], "")  # then hosts that are no Node
    chosen, short = place_group(["c", "d"], 1, 100 * mib, nodes)
    assert chosen == [] and short == ("1 of its ranks fit no host of its Topology: each needs 100.0 MiB; "
                                      "Node c is not Ready; Node d has 50.0 MiB free")


def test_a_group_models_further_groups_start_on_nodes_and_move_when_one_is_lost():
    mib = 2**20
    nodes = [Candidate("a", 100 * mib, True), Candidate("b", 300 * mib, True), Candidate("c", 500 * mib, True)]
    pool = ["a", "b", "c", "x", "y"]
    # rank 0 on the Node with the most free, the other ranks on Nodes with room, then on hosts that are no Node
    assert place_remote_groups(pool, 2, 2, 100 * mib, {}, nodes) == ({"c": ["c", "b"], "a": ["a", "x"]}, "")
    # placed groups stay while their Nodes are Ready; one with a Node lost moves, whichever rank that Node ran
    lost = [Candidate("a", 100 * mib, True), Candidate("b", 300 * mib, False), Candidate("c", 500 * mib, True)]
    assert place_remote_groups(pool, 2, 2, 100 * mib, {"a": ["a", "x"], "c": ["c", "b"]}, lost) == (
        {"a": ["a", "x"], "c": ["c", "y"]}, "")
    # rank 0 runs on a Node: a group whose Node left the cluster is placed again
    assert place_remote_groups(pool + ["gone"], 1, 2, 100 * mib, {"gone": ["gone", "x"]}, nodes) == (
        {"c": ["c", "b"]}, "")
    placed, short = place_remote_groups(["a", "b", "x"], 2, 2, 200 * mib, {}, nodes)
    assert placed == {"b": ["b", "x"]} and short == (
        "1 of its groups on worker Nodes fit no hosts of its Topology: rank 0 of each runs on a Node, and "
        "each rank needs 200.0 MiB; the most any Ready Node of its Topology left has free is 100.0 MiB")


def test_the_router_keeps_conversations_with_their_prefix_and_spreads_the_rest():
    from specd.serving.routing import Router

    router, nodes = Router(), ["a", "b"]
    system = list(range(1000, 1800))  # one system prompt for every conversation
    histories = [system + [i] * 100 for i in range(4)]
    homes = []
    for history in histories:  # four conversations open at once: they spread
        home = router.pick("m", nodes, history)
        router.started("m", home)
        homes.append(home)
    assert sorted(homes) == ["a", "a", "b", "b"]
    for i, history in enumerate(histories):  # later turns, each while its conversation is not in flight
        router.finished("m", homes[i])
        history += [7] * 150 + [8] * 60
        assert router.pick("m", nodes, history) == homes[i]
        router.started("m", homes[i])
    for _ in range(3):  # the home replica saturated: the conversation moves
        router.started("m", homes[0])
    histories[0] += [9] * 60
    assert router.pick("m", nodes, histories[0]) != homes[0]
    rr = Router("round-robin")
    assert [rr.pick("m", nodes, []) for _ in range(4)] == ["a", "b", "a", "b"]


def test_the_router_prefers_a_prefix_in_ram_then_one_on_disk():
    """A Model with a disk tier: a replica that restarted still holds what it was sent on its
    Node's disk, which beats a replica holding nothing and loses to one holding it in RAM."""
    from specd.serving.routing import Router

    router, nodes = Router(), ["a", "b", "c"]
    router.keeps_on_disk("m", True)
    session = list(range(3000, 5000))
    assert router.pick("m", ["a"], session) == "a"
    router.forget("m", "a")  # its engine restarted: its RAM is empty, its disk is not
    session += [1] * 100
    assert router.pick("m", nodes, session) == "a", "the disk beats a prefill"
    router.forget("m", "a")
    assert router.pick("m", ["b"], session) == "b"
    session += [2] * 100
    assert router.pick("m", nodes, session) == "b", "RAM beats disk"
    router.keeps_on_disk("m", False)  # the tier was turned off: a restart keeps nothing
    router.forget("m", "b")
    router.started("m", "b")
    assert router.pick("m", nodes, session + [3] * 100) == "a", "nothing held anywhere: the least busy first"


TEXT = st.text(st.characters(codec="utf-8"), max_size=20)  # what the API edge lets in: no lone surrogates
FLOAT = st.floats(allow_nan=False, allow_infinity=False, width=32)
REQUESTS = st.builds(
    GenerationRequest, TEXT, st.lists(st.integers(0, 2**31 - 1), max_size=8),
    st.builds(SamplingParams, FLOAT, FLOAT, st.integers(0, 100), FLOAT, st.none() | st.integers(0, 2**63 - 1),
              st.booleans(), st.integers(0, 20), st.lists(st.tuples(st.integers(0, 2**31 - 1), FLOAT),
                                                          max_size=3).map(tuple)),
    st.integers(1, 10**6), st.lists(TEXT, max_size=3).map(tuple),
    st.none() | st.builds(SpeculationConfig, st.sampled_from(list(Method)), st.integers(0, 16)),
    st.none() | TEXT, st.booleans())
LOGPROBS = st.builds(TokenLogprob, st.integers(0, 2**31 - 1), FLOAT,
                     st.lists(st.tuples(st.integers(0, 2**31 - 1), FLOAT), max_size=3).map(tuple))
OUTPUTS = st.builds(StepOutput, st.text(st.characters(exclude_categories=()), max_size=20), st.lists(st.integers(0, 2**31 - 1), max_size=4),
                    st.none() | st.lists(LOGPROBS, max_size=3), st.none() | st.sampled_from(["stop", "length"]),
                    st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.none() | TEXT,
                    st.none() | TEXT, st.none() | st.builds(
                        SpecStats, st.integers(0, 99), st.sampled_from(list(Method)), TEXT,
                        st.dictionaries(st.sampled_from(list(Method)), st.lists(st.integers(0, 99), min_size=3, max_size=3))))


@given(REQUESTS, OUTPUTS)
@settings(max_examples=200, deadline=None)
def test_what_a_head_and_a_worker_send_each_other_arrives_unchanged(request, output):
    """A request to a worker's engine and each output back, through JSON as they cross (lone
    surrogates in the output's text too: a model can emit them, and JSON escapes them)."""
    assert request_from_json(json.loads(json.dumps(request_to_json(request)))) == request
    assert output_from_json(json.loads(json.dumps(output_to_json(output)))) == output
