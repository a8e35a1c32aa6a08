"""Shared fixtures: forged test models and real daemons on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import urllib.request

ROOT = Path(__file__).resolve().parents[1]


def code_sample(name: str) -> str:
    """Python source to cut prompts from: a fixed file, so that editing a test
    does not change its prompts (several tests assume their prompts' greedy
    continuations run 48 tokens without an end of text)."""
    return (ROOT / "tests" / "data" / f"{name}_sample.txt").read_text()


# A llama of wide keys and values (``forge.families.build`` overrides): a 3,000-token prompt's KV
# is tens of MB, a short prompt's a few (tests of MLX's memory limit)
WIDE_KV = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
           "intermediate_size": 256, "num_hidden_layers": 4, "max_position_embeddings": 4096}


def run_engine(model, tokenizer, fn, draft_model=None, vision=None, **config):
    """Start an in-process engine (with ``vision``, a ``VisionTower``, where given), ``await
    fn(engine)``, shut it down; returns fn's result."""
    import asyncio

    from specd.engine.engine import Engine
    from specd.engine.scheduler import EngineConfig

    async def main():
        engine = Engine("t", model, tokenizer, EngineConfig(**config), drafter=draft_model, vision=vision)
        engine.start()
        try:
            return await fn(engine)
        finally:
            await engine.shutdown(1)
    return asyncio.run(main())


@pytest.fixture(scope="module")
def pair(forged):
    """The forged test pair, loaded per module (tests hook the target's modules): target, tokenizer, draft."""
    from mlx_lm import load

    target, tokenizer = load(str(forged / "target"))
    draft, _ = load(str(forged / "draft"))
    return target, tokenizer, draft


@pytest.fixture(scope="session")
def forged(tmp_path_factory) -> Path:
    """The deterministic random test pair (``OUT/target``, ``OUT/draft``)."""
    from specd.forge import forge

    out = tmp_path_factory.mktemp("forge")
    forge(out, preset="test", seed=0, log=lambda *a, **k: None)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_manifest(name: str, source: str | Path, **spec) -> str:
    extra = "".join(f"\n  {k}: {v}" for k, v in spec.items())
    return textwrap.dedent(f"""\
        apiVersion: specd.dev/v1alpha1
        kind: Model
        metadata:
          name: {name}
        spec:
          source: {source}""") + extra + "\n"


@dataclass
class NetnsHost:
    """A second "host": a network namespace behind a veth pair."""

    ns: str
    subnet: str  # {subnet}.1 is this end, {subnet}.2 the namespace's
    rsh: Path  # an ``SPECD_RSH`` that "ssh"es into the namespace
    link: str  # the namespace's end of the veth

    def cut(self, down: bool) -> None:
        """Cut the host off (its end of the link down: this end keeps its address), or reconnect it."""
        subprocess.run(["ip", "netns", "exec", self.ns, "ip", "link", "set", self.link, "down" if down else "up"],
                       check=True, capture_output=True)


def _claim_netns_tag() -> int:
    """A number no other test process's namespace uses (the test files run in several processes):
    from this process's, the first whose namespace ``ip netns add`` creates (it refuses one that exists)."""
    for offset in range(250):
        tag = (os.getpid() + offset) % 250
        made = subprocess.run(["ip", "netns", "add", f"specd-tp-{tag}"], capture_output=True, text=True)
        if made.returncode == 0:
            return tag
        if "exists" not in made.stderr:
            pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    pytest.skip("every test namespace name is taken")


@pytest.fixture(scope="module")
def netns_hosts(tmp_path_factory):
    """A second "host": a network namespace joined to this one by a veth pair
    (10.77.x.1 here, 10.77.x.2 there)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = _claim_netns_tag()
    ns, here, there = f"specd-tp-{tag}", f"sdtp{tag}a", f"sdtp{tag}b"
    subnet = f"10.77.{tag}"
    setup = [["ip", "link", "add", here, "type", "veth", "peer", "name", there],
             ["ip", "link", "set", there, "netns", ns],
             ["ip", "addr", "add", f"{subnet}.1/24", "dev", here], ["ip", "link", "set", here, "up"],
             ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", there],
             ["ip", "netns", "exec", ns, "ip", "link", "set", there, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True)
    except subprocess.CalledProcessError as err:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        pytest.skip(f"cannot make a network namespace here: {err.stderr.decode().strip()}")
    rsh = tmp_path_factory.mktemp("rsh") / "netns-rsh"
    rsh.write_text('#!/bin/sh\nhost="$1"; shift\nexec ip netns exec "$host" sh -c "$*"\n')
    rsh.chmod(0o755)
    try:
        yield NetnsHost(ns, subnet, rsh, there)
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    log_path: Path
    host: str = "127.0.0.1"
    admin_token: str | None = None  # sent with every request, when the daemon has one
    cluster_port: int = 0  # a head's or worker's port for cluster traffic (TLS)
    state: Path | None = None  # its state directory
    trust: bytes | None = None  # a cluster CA's certificate: ``get`` goes to the cluster port, over TLS, trusting it

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cluster_url(self) -> str:
        return f"https://{self.host}:{self.cluster_port}"

    def get(self, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """GET ``path`` (or POST ``body`` as JSON to it)."""
        base = self.url if self.trust is None else self.cluster_url
        request = urllib.request.Request(base + path, None if body is None else json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        if self.admin_token is not None:
            request.add_header("Authorization", f"Bearer {self.admin_token}")
        context = None if self.trust is None else ssl.create_default_context(cadata=self.trust.decode())
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_daemon(tmp: Path, manifests: dict[str, str], wait_ready: bool = True, *extra: str,
                 port: int | None = None, serve: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", netns: str | None = None, admin_token: str | None = None,
                 wrap: tuple[str, ...] = (), cluster_port: int | None = None) -> Daemon:
    """Start ``specd daemon`` (or ``specd serve SERVE...``) as its own process on a free
    port (or ``port``) of ``host`` (in network namespace ``netns``), and a free cluster port
    (or ``cluster_port``: a head's or worker's, TLS), with ``env`` added to the environment,
    and ``admin_token`` as its admin token (needed off loopback); ``wrap``: a command that runs
    the daemon's (``... "$@"``)."""
    mdir = tmp / "manifests"
    mdir.mkdir(parents=True, exist_ok=True)
    for fname, text in manifests.items():
        (mdir / fname).write_text(text)
    port = port or free_port()
    cluster_port = cluster_port or free_port()
    log_path = tmp / f"daemon-{port}.log"
    if admin_token is not None:
        (tmp / "admin-token").write_text(admin_token)
        extra += ("--admin-token-file", str(tmp / "admin-token"))
    command = ["serve", *serve] if serve else ["daemon", "--manifests", str(mdir)]
    cmd = list(wrap) + ([] if netns is None else ["ip", "netns", "exec", netns]) + [
        sys.executable, "-m", "specd.cli", *command,
        "--state-dir", str(tmp / "state"), "--host", host, "--port", str(port), "--cluster-port", str(cluster_port),
        *extra]
    proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    daemon = Daemon(proc, port, log_path, host, admin_token, cluster_port, tmp / "state")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{daemon.log()}")
        try:
            status, _ = daemon.get("/readyz" if wait_ready else "/healthz")
            if status == 200:
                return daemon
        except OSError:
            pass
        time.sleep(0.05)
    daemon.stop(signal.SIGKILL)
    raise RuntimeError(f"daemon not ready:\n{daemon.log()}")


@pytest.fixture(scope="session")
def daemon(forged, tmp_path_factory):
    """One daemon for the API tests: the forged target as ``tiny`` (no
    speculation by default) and as ``tiny-spec`` (paired with the forged draft)."""
    pairing = textwrap.dedent(f"""\
        apiVersion: specd.dev/v1alpha1
        kind: DraftPairing
        metadata:
          name: tiny-spec-draft
        spec:
          targetRef: tiny-spec
          method: draft
          source: {forged / "draft"}
          numSpeculativeTokens: 3
        """)
    d = start_daemon(tmp_path_factory.mktemp("daemon"),
                     {"models.yaml": model_manifest("tiny", forged / "target", maxBatchSize=16)
                      + "---\n" + model_manifest("tiny-spec", forged / "target") + "---\n" + pairing})
    yield d
    d.stop()


@pytest.fixture(scope="session")
def client(daemon):
    from openai import OpenAI

    return OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tokenizer(forged):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(forged / "target")


@pytest.fixture(scope="session")
def family_models(forged, tmp_path_factory):
    """Tiny random models of mlx-lm families (``specd.forge.families``), built on first use:
    ``get(family, seed, quantization)`` -> its directory."""
    from specd.forge.families import build

    root = tmp_path_factory.mktemp("families")
    built: dict[tuple, Path] = {}

    def get(family: str, seed: int = 0, quantization: dict | None = None) -> Path:
        key = (family, seed, None if quantization is None else tuple(sorted(quantization.items())))
        if key not in built:
            quantized = "" if quantization is None else f"-{quantization['mode']}{quantization['bits']}"
            name = f"{family}-{seed}{quantized}"
            built[key] = build(family, root / name, forged / "target", seed=seed, quantization=quantization)
        return built[key]
    return get


def two_sample_chi2(a_tokens: list[int], b_tokens: list[int]) -> tuple[float, float, int]:
    """Pearson's two-sample chi-square of two token samples (rare tokens pooled
    into one bin), its 0.999 quantile (Wilson-Hilferty) and degrees of freedom."""
    import numpy as np

    tokens = sorted(set(a_tokens) | set(b_tokens))
    a = np.array([a_tokens.count(t) for t in tokens], dtype=float)
    b = np.array([b_tokens.count(t) for t in tokens], dtype=float)
    common = (a + b) >= 10
    a = np.append(a[common], a[~common].sum())
    b = np.append(b[common], b[~common].sum())
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    expected_a = (a + b) * a.sum() / (a.sum() + b.sum())
    expected_b = (a + b) * b.sum() / (a.sum() + b.sum())
    stat = float(((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum())
    dof = len(a) - 1
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3
    return stat, float(limit), dof


@pytest.fixture(scope="module")
def chat_models(forged, tmp_path_factory):
    """The forged target in each tool-call family's chat conventions (``specd.forge.chat``)."""
    from specd.forge.chat import STYLES, chat_variant

    root = tmp_path_factory.mktemp("chat")
    return {style: chat_variant(forged / "target", root / style, style) for style in STYLES} | {
        "hermes-draft": chat_variant(forged / "draft", root / "hermes-draft", "hermes")}


@pytest.fixture(scope="module")
def chat_daemon(chat_models, tmp_path_factory):
    """A daemon serving one model per tool-call format; ``hermes-spec`` is paired with a draft model."""
    from specd.forge.chat import STYLES

    pairing = textwrap.dedent(f"""\
        apiVersion: specd.dev/v1alpha1
        kind: DraftPairing
        metadata:
          name: hermes-spec-draft
        spec:
          targetRef: hermes-spec
          method: draft
          source: {chat_models["hermes-draft"]}
          numSpeculativeTokens: 3
        """)
    manifests = [model_manifest(style, chat_models[style]) for style in STYLES]
    manifests += [model_manifest("hermes-spec", chat_models["hermes"]), pairing]
    daemon = start_daemon(tmp_path_factory.mktemp("chat-daemon"), {"models.yaml": "---\n".join(manifests)})
    yield daemon
    daemon.stop()


def head_for(target, version: int, seed: int = 0):
    """A random EAGLE head of the target's shape (EAGLE-3 fusing layers 0, 1, 2)."""
    import mlx.core as mx

    from specd.core.loader import text_config
    from specd.speculation.eagle.head import EagleConfig, EagleHead

    a = text_config(target)  # a multimodal checkpoint's text half: its nested text_config
    config = EagleConfig(version, a["hidden_size"], a["intermediate_size"], a["num_attention_heads"],
                         a["num_key_value_heads"], a["vocab_size"], feature_layers=(0, 1, 2) if version == 3 else ())
    mx.random.seed(seed)
    head = EagleHead(config)
    mx.eval(head.parameters())
    return head


async def measure_plain_decoding_best(engine) -> None:
    """Put ``engine`` under a goodput policy whose measurements say plain decoding pays best at every
    batch size, with no try of speculating due: its rows decode plainly, and may run ahead."""
    import asyncio

    from specd.speculation.config import PolicySettings
    from specd.speculation.exploration import Realised

    speculator = engine.scheduler.speculator
    for bucket in (1, 2, 4, 8):
        plain = speculator.feedback.realised[bucket] = Realised()
        plain.baseline_left, plain.next_try[Realised.PLAIN] = 0, 10 ** 9
    engine.set_policy(PolicySettings(), "goodput")
    while speculator.feedback.controller.mode != "goodput":
        await asyncio.sleep(0.001)


@contextmanager
def counting_steps_run_ahead() -> Iterator[list[int]]:
    """Within it, ``[n]``: the decode steps that took a step started ahead of them."""
    from unittest import mock

    from specd.engine import runner

    taken = [0]
    original = runner.ModelRunner._ahead_for

    def counted(self, step):
        launched = original(self, step)
        taken[0] += launched is not None
        return launched

    with mock.patch.object(runner.ModelRunner, "_ahead_for", counted):
        yield taken
