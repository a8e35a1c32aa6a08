"""The wire between Macs: head and workers speak TLS under the head's own CA, pinned by the join
token. Recording proxies on both links see no prompt, no reply and no token; a head or a worker
presenting another certificate is refused; a token that pins no CA, or a join in clear text, is
refused before anything is sent."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import yaml
from aiohttp import web

from conftest import ROOT, free_port, model_manifest, start_daemon
from daemons import model_status, wait_for
from links import LinkProxy
from specd.control.agent import NodeAgent
from specd.serving.cluster import Cluster
from specd.serving.tls import ClusterCA, JoinToken, NodeIdentity
from specd.store import Store
from clusters import head, join_token, node_ready, nodes, worker
from test_cluster import BUDGETS, chat, join

SECRET = "s3cret-cluster-token"


def test_traffic_between_head_and_worker_is_encrypted_both_ways(forged, tmp_path):
    """The worker joins the head, and the head reaches the worker, through recording proxies: a
    chat answered through the head by the worker's replica leaves neither its prompt, its reply,
    nor the cluster token readable on either link; the worker's address is its cluster port,
    https, and its plain port refuses the head's calls."""
    h = head(tmp_path)
    to_head = LinkProxy(h.cluster_port)
    worker_port = free_port()
    to_worker = LinkProxy(worker_port)
    w = start_daemon(tmp_path / "w1", {}, True, "--join", f"https://127.0.0.1:{to_head.port}", "--token-file",
                     str(join_token(h)), "--node-name", "w1", "--memory-limit", "2Gi",
                     "--advertise", f"https://127.0.0.1:{to_worker.port}", cluster_port=worker_port)
    try:
        wait_for(lambda: node_ready(h, "w1"), 30, "w1 joined through the proxy")
        assert nodes(h)["w1"]["spec"]["address"] == f"https://127.0.0.1:{to_worker.port}"
        manifest = yaml.safe_load(model_manifest("m", forged / "target", **BUDGETS))
        assert h.get("/apis/specd.dev/v1alpha1/apply", {"items": [manifest]})[0] == 200
        wait_for(lambda: model_status(h, "m").get("readyReplicas") == 1, 120, "the replica on w1")
        prompt = "def confidential_payroll_totals(employees):"
        reply = chat(h.url, [{"role": "user", "content": prompt}], max_tokens=24).choices[0].message.content
        assert reply and chat(w.url, [{"role": "user", "content": prompt}], max_tokens=24) \
            .choices[0].message.content == reply
        for link in (to_head, to_worker):
            assert len(link.seen) > 1000  # the traffic went through it
            for secret in (prompt, "confidential_payroll", SECRET, reply[:16]):
                assert secret.encode() not in link.seen, secret
    finally:
        for d in (h, w):
            d.stop(signal.SIGKILL)


def test_a_head_presenting_another_ca_is_refused_and_never_sent_the_token(tmp_path):
    """A worker holding head A's join token, pointed at head B (a CA of its own, the same secret):
    it refuses B's certificate authority before any call that carries the token, and never joins."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = head(tmp_path / "a")
    b = head(tmp_path / "b")
    try:
        stray = worker(tmp_path, "w1", b, join_token(a))
        try:
            wait_for(lambda: "the join token does not pin" in stray.log(), 30, "the refusal in the worker's log")
            assert "w1" not in nodes(b) and "w1" not in nodes(a)
            assert JoinToken.parse(join_token(a).read_text()).ca_hash not in join_token(b).read_text()
        finally:
            stray.stop(signal.SIGKILL)
    finally:
        for d in (a, b):
            d.stop(signal.SIGKILL)


def test_a_head_serving_the_pinned_ca_with_another_certificate_gets_no_token(tmp_path):
    """A man in the middle can serve the real head's CA certificate (it is public), but not a
    serving certificate that CA signed: the worker's join fails its handshake, and the impostor
    never sees the token."""
    ca, other = ClusterCA(tmp_path / "ca"), ClusterCA(tmp_path / "other")
    token = ca.join_token(SECRET)
    heard: list[str] = []

    async def main() -> str:
        app = web.Application()

        async def public_ca(request: web.Request) -> web.Response:
            return web.Response(body=ca.pem)
        app.router.add_get("/cluster/v1/ca", public_ca)

        async def any_call(request: web.Request) -> web.Response:
            heard.append(request.headers.get("Authorization", ""))
            return web.json_response({})
        app.router.add_post("/{tail:.*}", any_call)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=other.server_context(["127.0.0.1"])).start()
        agent = NodeAgent(f"https://127.0.0.1:{port}", token, "w1", "https://127.0.0.1:1", lambda: {"status": {}},
                          NodeIdentity(), tmp_path / "node")
        task = asyncio.ensure_future(agent.run())
        try:
            for _ in range(100):
                if agent.refusal:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await runner.cleanup()
        return agent.refusal
    refusal = asyncio.run(main())
    assert "refused the head's certificate" in refusal and "certificate verify failed" in refusal, refusal
    assert heard == []


def test_the_head_trusts_only_workers_its_ca_certified(tmp_path):
    """The head's client of its workers (``Cluster.session``) completes a handshake with a
    listener whose certificate the cluster's CA signed for its address, and refuses one that
    presents another CA's certificate for the same address."""
    ca, other = ClusterCA(tmp_path / "ca"), ClusterCA(tmp_path / "other")
    cluster = Cluster(Store(tmp_path / "specd.db"), SECRET, ca)
    certified = NodeIdentity()
    certified.certify(ca.sign(certified.signing_request().encode(), ["127.0.0.1"]).decode(), tmp_path / "node")
    impostor = other.server_context(["127.0.0.1"])

    async def main() -> list[str]:
        app = web.Application()

        async def echo_token(request: web.Request) -> web.Response:
            return web.Response(text=request.headers.get("Authorization", ""))
        app.router.add_get("/", echo_token)
        runner = web.AppRunner(app)
        await runner.setup()
        outcomes = []
        try:
            for context in (certified.server, impostor):
                port = free_port()
                await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
                async with cluster.session() as session:
                    try:
                        async with session.get(f"https://127.0.0.1:{port}/") as response:
                            outcomes.append(await response.text())
                    except aiohttp.ClientConnectorCertificateError as err:
                        outcomes.append(f"refused: {type(err.certificate_error).__name__}")
        finally:
            await runner.cleanup()
        return outcomes
    assert asyncio.run(main()) == [f"Bearer {SECRET}", "refused: SSLCertVerificationError"]


def test_joins_need_tls_and_a_token_that_pins_the_ca(tmp_path):
    """A join on the head's plain port is refused (403) before the token is looked at; a worker
    started with the bare secret, or with an http:// head, does not start, and says why."""
    h = head(tmp_path)
    try:
        status, body = join(h, "w3", SECRET, url=h.url)
        assert status == 403 and body["reason"] == "TLSRequired", body
        status, body = join(h, "w3", SECRET)  # the same join over TLS
        assert status == 200 and body["certificate"].startswith("-----BEGIN CERTIFICATE-----"), body
        bare = tmp_path / "bare-secret"
        bare.write_text(SECRET)
        for url, token, reason in ((h.cluster_url, bare, "not a join token"),
                                   (h.url, join_token(h), "over TLS (https://HEAD:CLUSTER_PORT)")):
            proc = subprocess.run([sys.executable, "-m", "specd.cli", "daemon", "--state-dir", str(tmp_path / "w"),
                                   "--port", str(free_port()), "--join", url, "--token-file", str(token)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 2 and reason in proc.stderr, proc.stderr
    finally:
        h.stop(signal.SIGKILL)
