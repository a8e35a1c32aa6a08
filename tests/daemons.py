"""Driving a daemon under test the way a user does: the ``specd`` command against it, its
objects' status, its metrics through a real Prometheus parser, and waiting for a condition."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT


def specd(daemon, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "specd.cli", *args, "--server", daemon.url], input=stdin,
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"specd {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def wait_for(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def get(daemon, kind: str, name: str) -> dict:
    return json.loads(specd(daemon, "get", kind, name, "-o", "json").stdout)


def ready(daemon, kind: str, name: str) -> bool:
    proc = specd(daemon, "get", kind, name, "-o", "json", check=False)
    if proc.returncode:
        return False
    conds = json.loads(proc.stdout).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def model_status(daemon, name: str) -> dict:
    """The Model's status from the admin API ({} while it is not stored)."""
    status, body = daemon.get(f"/apis/specd.dev/v1alpha1/models/{name}")
    return json.loads(body).get("status", {}) if status == 200 else {}


def scrape(daemon) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` by (name, sorted labels)."""
    status, body = daemon.get("/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def topology(name: str = "loopback", hosts: tuple[str, ...] = ("rank0", "rank1"), **extra) -> str:
    """Hosts on this machine, named ``hosts`` (a cluster Node's name puts a rank's memory there)."""
    fields = "".join(f"\n  {k}: {v}" for k, v in extra.items())
    listed = "".join(f"\n    - {{name: {h}, address: 127.0.0.1}}" for h in hosts)
    return textwrap.dedent(f"""\
        apiVersion: specd.dev/v1alpha1
        kind: Topology
        metadata:
          name: {name}
        spec:
          backend: ring
          launcher: local
          threadsPerRank: 1
          hosts:""") + listed + fields + "\n"
