"""Daemon lifecycle: readiness, failure isolation, manifest rejection, SIGTERM drain."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from openai import OpenAI

from conftest import ROOT, model_manifest, start_daemon


def chat(url: str, model: str, **kw):
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "def f():"}],
                                          temperature=0, **kw)


def test_readiness_is_503_while_loading_then_200(forged, tmp_path):
    """The model's config.json is a FIFO: placing and loading block on it until the test
    writes the real config, so the daemon is observably up but not ready."""
    slow = tmp_path / "slow"
    shutil.copytree(forged / "target", slow)
    config = (slow / "config.json").read_bytes()
    (slow / "config.json").unlink()
    os.mkfifo(slow / "config.json")
    daemon = start_daemon(tmp_path, {"m.yaml": model_manifest("slow", slow)}, False)
    try:
        status, body = daemon.get("/readyz")  # its memory request is read from config.json too
        assert status == 503 and (b"Loading" in body or b"reading its memory request" in body), body
        assert daemon.get("/healthz")[0] == 200

        def feed():  # every reader of config.json gets the real content, once
            while True:
                with open(slow / "config.json", "wb") as f:
                    f.write(config)
                time.sleep(0.2)  # let that reader reach EOF before the next open

        threading.Thread(target=feed, daemon=True).start()
        deadline = time.monotonic() + 60
        while daemon.get("/readyz")[0] != 200:
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        assert chat(daemon.url, "slow", max_tokens=4).usage.completion_tokens == 4
    finally:
        assert daemon.stop() == 0


def test_failed_model_is_isolated(forged, tmp_path):
    manifests = {"good.yaml": model_manifest("good", forged / "target"),
                 "bad.yaml": model_manifest("broken", tmp_path / "does-not-exist")}
    daemon = start_daemon(tmp_path, manifests, False)
    try:
        deadline = time.monotonic() + 60
        while True:  # until only the broken model keeps the daemon unready
            status, body = daemon.get("/readyz")
            if b"Failed" in body and b'"good"' not in body:
                break
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        assert status == 503
        assert b"broken" in body and b"does not exist" in body
        assert chat(daemon.url, "good", max_tokens=5).choices[0].finish_reason == "length"
        from openai import APIStatusError
        with pytest.raises(APIStatusError) as err:
            chat(daemon.url, "broken", max_tokens=5)
        assert err.value.status_code == 503
    finally:
        daemon.stop()


@pytest.mark.parametrize("manifest,path", [
    ("apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: m}\nspec: {source: ./x, maxBatchSize: -1}\n",
     "spec.maxBatchSize"),
    ("apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: m}\nspec: {source: ./x, colour: red}\n",
     "spec.colour"),
    ("apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: Bad_Name!}\nspec: {source: ./x}\n",
     "metadata.name"),
    ("apiVersion: v9\nkind: Model\nmetadata: {name: m}\nspec: {source: ./x}\n", "apiVersion"),
    ("apiVersion: specd.dev/v1alpha1\nkind: Gizmo\nmetadata: {name: m}\nspec: {}\n", "kind"),
    ("apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: m}\nspec: {source: 3}\n", "spec.source"),
    ("apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {name: m}\nspec: {}\n", "spec.source"),
    ("kind: Model\n  bad: [yaml\n", ""),
])
def test_invalid_manifest_is_rejected_with_path(tmp_path, manifest, path):
    (tmp_path / "bad.yaml").write_text(manifest)
    proc = subprocess.run([sys.executable, "-m", "specd.cli", "daemon", "--manifests", str(tmp_path),
                           "--port", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "bad.yaml" in proc.stderr and path in proc.stderr, proc.stderr


def test_sigterm_drains_in_flight_requests(forged, tmp_path):
    """...then exits 0 and removes its pid file."""
    pid_file = tmp_path / "run" / "daemon.pid"
    daemon = start_daemon(tmp_path, {"m.yaml": model_manifest("m", forged / "target")}, True,
                          "--pid-file", str(pid_file))
    assert pid_file.read_text() == f"{daemon.proc.pid}\n"
    client = OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="m", prompt="import os\n", max_tokens=400, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    first = next(stream)
    daemon.proc.send_signal(signal.SIGTERM)
    chunks = [first, *stream]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 400
    assert daemon.proc.wait(30) == 0
    assert not pid_file.exists()


def test_a_killed_daemons_pid_file_is_replaced_and_a_failed_start_removes_its_own(forged, tmp_path):
    """A stale pid file (kill -9 leaves one) does not stop the next daemon, which
    writes its own; a daemon that cannot start (the port is taken) removes it."""
    pid_file = tmp_path / "daemon.pid"
    pid_file.write_text("999999999\n")
    daemon = start_daemon(tmp_path, {"m.yaml": model_manifest("m", forged / "target")}, True,
                          "--pid-file", str(pid_file))
    try:
        assert pid_file.read_text() == f"{daemon.proc.pid}\n"
        busy = subprocess.run([sys.executable, "-m", "specd.cli", "daemon", "--state-dir", str(tmp_path / "other"),
                               "--port", str(daemon.port), "--pid-file", str(tmp_path / "other.pid")],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert busy.returncode != 0 and "address already in use" in busy.stderr.lower(), busy.stderr
        assert not (tmp_path / "other.pid").exists()
    finally:
        daemon.proc.kill()
        daemon.proc.wait(30)
    assert pid_file.read_text() == f"{daemon.proc.pid}\n"  # left behind by kill -9, as documented


def test_mismatched_draft_pairing_fails_the_pairing_not_the_model(forged, tmp_path):
    from specd.forge.llama import LlamaShape, build, hf_config, save

    shape = LlamaShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, vocab_size=700)
    save(build(shape), hf_config(shape, [0, 2], 0), forged / "target", tmp_path / "odd-draft")
    pairing = ("apiVersion: specd.dev/v1alpha1\nkind: DraftPairing\nmetadata: {name: odd}\n"
               f"spec: {{targetRef: paired, method: draft, source: {tmp_path / 'odd-draft'}}}\n")
    manifests = {"a.yaml": model_manifest("paired", forged / "target") + "---\n" + pairing}
    daemon = start_daemon(tmp_path, manifests)
    try:
        def pairing_condition():
            obj = json.loads(daemon.get("/apis/specd.dev/v1alpha1/draftpairings/odd")[1])
            return (obj.get("status", {}).get("conditions") or [None])[0]
        deadline = time.monotonic() + 60
        while (cond := pairing_condition()) is None or cond["reason"] != "DraftLoadFailed":
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        assert cond["status"] == "False" and "vocabulary" in cond["message"]
        assert chat(daemon.url, "paired", max_tokens=3).usage.completion_tokens == 3
    finally:
        daemon.stop()
