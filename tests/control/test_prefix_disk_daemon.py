"""The prefix cache's disk tier through the daemon: a conversation's prefix, cached before a
rollout restart, a scale to zero, an eviction or a daemon restart, is read from disk after it (the
answer's ``cached_tokens``), and every answer is what a Model without any prefix cache gives. A disk
that fills up leaves the daemon serving, and says so in status and metrics.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from openai import OpenAI

from conftest import code_sample, model_manifest, start_daemon
from daemons import model_status, scrape, specd, wait_for

SYSTEM = code_sample("speculation")[:3000]  # about a thousand tokens: three blocks and more
QUESTIONS = ["What does this code do?", "And the verifier?", "Which tests cover it?"]


MEMORY = "{memory: 1Gi}"  # each Model's request: the node (--memory-limit 3.5Gi) holds three
NODE = ("--memory-limit", str(int(3.5 * 2**30)))


def manifests(forged, disk: str = "{maxBytes: 64Mi}") -> dict[str, str]:
    """``cold`` and ``warm`` stay loaded; ``nap`` goes to zero when idle; ``brief`` and ``other``
    load on demand, and either evicts the other (the third place on the node)."""
    at_zero = "{minReplicas: 0, idleSeconds: 600}"
    return {"m.yaml": "---\n".join([
        model_manifest("cold", forged / "target", prefixCache="{maxBytes: 0}", resources=MEMORY),
        model_manifest("warm", forged / "target", prefixCache=f"{{disk: {disk}}}", resources=MEMORY),
        model_manifest("nap", forged / "target", prefixCache="{disk: {}}", resources=MEMORY,
                       scaling="{minReplicas: 0, idleSeconds: 2}"),
        model_manifest("brief", forged / "target", prefixCache="{disk: {}}", resources=MEMORY, scaling=at_zero),
        model_manifest("other", forged / "target", resources=MEMORY, scaling=at_zero)])}


def turn(daemon, model: str, messages: list[dict]) -> tuple[str, int]:
    client = OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens


def conversation(turns: int, answers: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[t]})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": answers[t]})
    return messages


def events(daemon, name: str, reason: str) -> int:
    items = json.loads(daemon.get(f"/apis/specd.dev/v1alpha1/models/{name}/events")[1])["items"]
    return sum(e["reason"] == reason for e in items)


def served_from_disk(daemon, model: str, messages: list[dict]) -> str:
    """The answer, checked against the Model without a cache, and started from disk."""
    answer, cached = turn(daemon, model, messages)
    expected, _ = turn(daemon, "cold", messages)
    assert answer == expected
    assert cached >= 768, f"{cached} tokens cached: the blocks on disk were not read"
    return answer


def test_a_prefix_survives_restarts_scale_to_zero_eviction_and_a_daemon_restart(forged, tmp_path):
    d = start_daemon(tmp_path, manifests(forged), True, *NODE)
    try:
        first, cached = turn(d, "warm", conversation(1, []))
        assert cached == 0

        loaded = events(d, "warm", "Ready")
        specd(d, "rollout", "restart", "model", "warm")
        wait_for(lambda: events(d, "warm", "Ready") > loaded, 60, "warm loaded again")
        second = served_from_disk(d, "warm", conversation(2, [first]))

        assert turn(d, "nap", conversation(1, []))[0] == first
        wait_for(lambda: events(d, "nap", "Idle"), 30, "nap unloaded when idle")
        assert served_from_disk(d, "nap", conversation(2, [first])) == second
        wait_for(lambda: events(d, "nap", "Idle") > 1, 30, "nap unloaded again")

        assert turn(d, "brief", conversation(1, []))[0] == first
        turn(d, "other", conversation(1, []))  # no room beside cold, warm and brief: brief is evicted
        assert events(d, "brief", "Evicted")
        assert served_from_disk(d, "brief", conversation(2, [first])) == second
    finally:
        d.stop()

    d = start_daemon(tmp_path, manifests(forged), True, *NODE)
    try:
        served_from_disk(d, "warm", conversation(3, [first, second]))
        samples = scrape(d)
        warm = (("model_name", "warm"),)
        assert samples[("specd_prefix_disk_hit_tokens_total", warm)] >= 768
        assert samples[("specd_prefix_disk_read_bytes_total", warm)] > 0
        assert samples[("specd_prefix_disk_restore_seconds_count", warm)] == 1
        assert samples[("specd_prefix_disk_available", warm)] == 1
        assert 0 < samples[("specd_prefix_disk_bytes", warm)] <= samples[("specd_prefix_disk_max_bytes", warm)]
        disk = wait_for(lambda: (s := model_status(d, "warm")["prefixCache"]["disk"])["hitTokens"] and s, 30,
                        "status reports the disk hits")
        assert disk["hitTokens"] >= 768 and disk["path"] == str(tmp_path / "state" / "prefix-cache" / "warm")
        assert not any(disk["refusedBlocks"].values())
        described = specd(d, "describe", "model", "warm").stdout
        assert "prefix-cache" in described
    finally:
        d.stop()


def can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
                           capture_output=True)
    return probe.returncode == 0


def test_a_full_disk_keeps_the_daemon_serving_and_says_so(forged, tmp_path):
    """The tier's directory on a filesystem of 300 KiB (a tmpfs in the daemon's own mount
    namespace): the first block fits, the next write fails with ENOSPC."""
    small = tmp_path / "small"
    small.mkdir()
    if not can_mount_tmpfs(small):
        pytest.skip("mounting a tmpfs in a mount namespace is not permitted here")
    wrap = ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=300k tmpfs {small} && exec "$@"', "sh")
    d = start_daemon(tmp_path, manifests(forged, disk=f"{{path: {small}, maxBytes: 10Mi}}"), True, *NODE, wrap=wrap)
    try:
        answers = []
        for t in range(1, 4):
            answer, _ = turn(d, "warm", conversation(t, answers))
            assert answer == turn(d, "cold", conversation(t, answers))[0]
            answers.append(answer)
        disk = wait_for(lambda: (s := model_status(d, "warm")["prefixCache"]["disk"])["error"] and s, 30,
                        "the tier reports the full disk")
        assert not disk["available"] and "No space left" in disk["error"] and disk["droppedBlocks"] > 0
        samples = scrape(d)
        assert samples[("specd_prefix_disk_available", (("model_name", "warm"),))] == 0
        assert samples[("specd_prefix_disk_dropped_blocks_total", (("model_name", "warm"),))] > 0
        assert d.get("/readyz")[0] == 200
    finally:
        d.stop()
