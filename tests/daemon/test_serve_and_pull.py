"""A newcomer's first commands: ``specd serve MODEL`` in one line, ``specd pull``
with progress (resumed after an interruption), a hub Model's download shown in
status and metrics, a hub Model with no network backing off, and the CLI cut
short by a pipe. Hub traffic goes to a local mirror (``hub_mirror``) speaking
the Hub's HTTP protocol to the real ``huggingface_hub`` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import openai
import pytest
import yaml

from conftest import ROOT, free_port, start_daemon
from daemons import model_status, scrape, wait_for
import hub_mirror
from hub_mirror import HubMirror
from specd.api.manifest import parse_documents
from specd.engine.resources import safetensors_bytes

REPO = "specd/tiny"


def specd(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def ready_reason(daemon, name: str) -> str | None:
    conditions = model_status(daemon, name).get("conditions", [])
    return next((c["reason"] for c in conditions if c["type"] == "Ready"), None)


@pytest.fixture
def hub_env(tmp_path):
    """A Hugging Face cache of this test's own, online, with no token and no telemetry."""
    return hub_mirror.hub_env(tmp_path / "hub")


def test_serve_one_command(forged, tmp_path):
    """``specd serve DIR --ngram`` serves the directory under its own name, with the
    pairing its flags imply; ``--dry-run`` prints that manifest; the next ``specd serve``
    on the same state replaces what the previous one declared."""
    dry = specd("serve", str(forged / "target"), "--ngram", "-k", "4", "--dry-run", "-o", "yaml")
    assert dry.returncode == 0, dry.stderr
    resources = parse_documents(dry.stdout, "dry-run")
    assert [(r.kind, r.name) for r in resources] == [("Model", "target"), ("DraftPairing", "target-ngram")]
    assert yaml.safe_load_all(dry.stdout) and resources[0].raw_spec["source"] == str(forged / "target")
    assert resources[1].raw_spec == {"targetRef": "target", "method": "ngram", "numSpeculativeTokens": 4}

    port = free_port()
    first = start_daemon(tmp_path, {}, True, port=port, serve=(str(forged / "target"), "--ngram"))
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "def f(x):"}],
                                               max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        assert (reply.usage.speculation["method"], reply.usage.speculation["source"]) == ("ngram", "model")
        listed = specd("get", "models", "--server", first.url)
        assert listed.stdout.split("\n")[1].split()[:3] == ["target", "True", "Loaded"], listed.stdout
        # the CLI cut short by its reader stops quietly
        piped = subprocess.run(f"{sys.executable} -m specd.cli describe model target --server {first.url} | head -1",
                               shell=True, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert piped.stdout.startswith("Name:") and "Traceback" not in piped.stderr, piped.stderr
    finally:
        assert first.stop() == 0

    second = start_daemon(tmp_path, {}, True, port=port, serve=(str(forged / "draft"), "--name", "small"))
    try:
        status, body = second.get("/v1/models")
        assert [m["id"] for m in json.loads(body)["data"]] == ["small"]
        status, body = second.get("/apis/specd.dev/v1alpha1/draftpairings")
        assert json.loads(body)["items"] == []
    finally:
        second.stop()


def test_serve_hub_model_without_network_backs_off(tmp_path, hub_env):
    """No hub to reach: the Model waits in BackOff with its next attempt, and says why."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    daemon = start_daemon(tmp_path, {}, False, serve=(REPO,), env={**hub_env, "HF_ENDPOINT": dead})
    try:
        wait_for(lambda: ready_reason(daemon, "tiny") == "BackOff", 60, "BackOff")
        status = model_status(daemon, "tiny")
        assert status["nextAttemptSeconds"] > 0
        message = next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
        assert "internet connection" in message or "connect" in message.lower(), message
        listed = specd("get", "models", "--server", daemon.url)
        assert "BackOff" in listed.stdout, listed.stdout
    finally:
        daemon.stop()


def test_a_hub_model_that_can_never_fit_is_not_downloaded(forged, tmp_path, hub_env):
    """A hub Model bigger than the node is Unschedulable with the numbers, read from its
    safetensors header on the hub (a range request) and its config.json: its weights are
    never downloaded."""
    mirror = HubMirror({REPO: forged / "target"})
    env = {**hub_env, "HF_ENDPOINT": mirror.start()}
    daemon = start_daemon(tmp_path, {}, False, "--memory-limit", "32Mi", serve=(REPO,), env=env)
    try:
        wait_for(lambda: ready_reason(daemon, "tiny") == "Unschedulable", 60, "Unschedulable")
        status = model_status(daemon, "tiny")
        message = next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
        assert "can never fit" in message, message
        assert status["resources"]["requests"]["weights"] == safetensors_bytes(forged / "target")
        weights = (forged / "target" / "model.safetensors").stat().st_size
        assert 0 < mirror.bytes_sent["model.safetensors"] < weights, mirror.bytes_sent  # the header's range only
        assert "download" not in status
    finally:
        daemon.stop()
        mirror.stop()


def fetched(mirror: HubMirror) -> Counter:
    """How many times each file was downloaded from the mirror."""
    return Counter(path.rsplit("/", 1)[1] for method, path in mirror.requests if method == "GET" and "/resolve/" in path)


def test_pull_shows_progress_and_resumes(forged, tmp_path, hub_env):
    """``specd pull``: a bar with bytes and rate; killed with the weights half there, the
    next pull keeps the files the first completed and fetches only the rest, whole."""
    mirror = HubMirror({REPO: forged / "target"}, bytes_per_second=100_000)
    env = {**hub_env, "HF_ENDPOINT": mirror.start()}
    try:
        blobs = Path(hub_env["HF_HUB_CACHE"]) / "models--specd--tiny" / "blobs"
        cut = subprocess.Popen([sys.executable, "-m", "specd.cli", "pull", REPO], cwd=ROOT,
                               env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: len([p for p in blobs.glob("*") if not p.name.endswith(".incomplete")]) >= 4
                 and any(blobs.glob("*.incomplete")), 60, "the small files in, the weights partly")
        cut.kill()
        _, bar = cut.communicate(timeout=30)
        assert "B/s" in bar and "specd/tiny" in bar, bar  # tqdm's bytes and rate
        fetched_before = fetched(mirror)
        mirror.set_rate(None)
        pulled = specd("pull", f"{REPO}@main", env=env)
        assert pulled.returncode == 0, pulled.stderr
        assert fetched(mirror) - fetched_before == Counter({"model.safetensors": 1})
        snapshot = Path(pulled.stdout.split(" in ")[1].split(" (")[0])
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            assert (snapshot / name).read_bytes() == (forged / "target" / name).read_bytes(), name
        # cached now: a third pull fetches nothing, and works offline too
        assert "0.0 MiB fetched now" in specd("pull", REPO, env=env).stdout
        offline = specd("pull", REPO, env={**env, "HF_HUB_OFFLINE": "1"})
        assert offline.returncode == 0 and "from the cache" in offline.stdout, offline.stderr
        assert specd("pull", "specd/absent", env=env).returncode == 1
    finally:
        mirror.stop()


def test_downloading_model_shows_progress(forged, tmp_path, hub_env):
    """A hub Model whose weights are still arriving is ``Downloading``, with bytes done
    and total in status and /metrics; once they are in, it loads and answers."""
    mirror = HubMirror({REPO: forged / "target"}, bytes_per_second=100_000)
    env = {**hub_env, "HF_ENDPOINT": mirror.start()}
    daemon = start_daemon(tmp_path, {}, False, serve=(REPO,), env=env)
    try:
        status = wait_for(lambda: (s := model_status(daemon, "tiny")).get("download", {}).get("bytes") and s, 60,
                          "download progress in status")
        assert status["phase"] == "Downloading" and 0 < status["download"]["bytes"] < status["download"]["totalBytes"]
        assert ready_reason(daemon, "tiny") == "Downloading"
        samples = scrape(daemon)
        total = samples[("specd_model_download_bytes", (("kind", "total"), ("model_name", "tiny")))]
        assert total == status["download"]["totalBytes"]
        mirror.set_rate(None)
        wait_for(lambda: ready_reason(daemon, "tiny") == "Loaded", 60, "the model to load")
        assert scrape(daemon)[("specd_model_download_bytes", (("kind", "done"), ("model_name", "tiny")))] == total
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="def", max_tokens=4,
                                         temperature=0).usage.completion_tokens == 4
    finally:
        daemon.stop()
        mirror.stop()
