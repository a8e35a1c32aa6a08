#!/usr/bin/env python3
"""Tensor parallelism on loopback: a 2-rank ring group vs a single process, through the daemon.

One daemon serves the demo target twice — ``single`` in-process and ``tp`` on
a two-rank ``ring`` Topology on 127.0.0.1 — each with the demo draft paired.
The script

1. checks greedy parity: every prompt with every method (none, ngram, draft),
   all fired at once at ``tp`` (mixed batches) and at ``single``; the texts
   and completion-token counts must be identical;
2. measures single-stream per-token latency (streamed, ``--runs`` runs,
   medians) for both models, plain and with each speculation method;
3. reports communication per step: the control traffic rank 0 broadcasts
   (measured: bytes and steps from its status reports) and the activations
   the sharded layers all-reduce (from the model's shape: every layer
   all-sums the attention and the MLP output, ``B x W x hidden`` float32).

Both ranks and the daemon share this machine's cores, so the 2-rank figures
measure the coordination overhead, not a speed-up.

    python ops/bench/tensor_parallel.py --pair models/demo --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def read_config(path):\n    with open(path) as f:\n",
           "    def __repr__(self):\n        return "]
METHODS = ["none", "ngram", "draft"]


def manifests(pair: Path) -> str:
    target, draft = (pair / "target").resolve(), (pair / "draft").resolve()
    docs = [textwrap.dedent("""\
        apiVersion: specd.dev/v1alpha1
        kind: Topology
        metadata: {name: loopback}
        spec:
          backend: ring
          launcher: local
          threadsPerRank: 1
          hosts:
            - {name: rank0, address: 127.0.0.1}
            - {name: rank1, address: 127.0.0.1}
        """)]
    for name, extra in (("tp", "\n  topologyRef: loopback"), ("single", "")):
        docs.append(f"apiVersion: specd.dev/v1alpha1\nkind: Model\nmetadata: {{name: {name}}}\n"
                    f"spec:\n  source: {target}\n  maxBatchSize: 32{extra}\n")
        docs.append(f"apiVersion: specd.dev/v1alpha1\nkind: DraftPairing\nmetadata: {{name: {name}-draft}}\n"
                    f"spec:\n  targetRef: {name}\n  method: draft\n  source: {draft}\n  numSpeculativeTokens: 3\n")
    return "---\n".join(docs)


def start_daemon(workdir: Path, pair: Path) -> tuple[subprocess.Popen, str]:
    (workdir / "manifests").mkdir()
    (workdir / "manifests" / "models.yaml").write_text(manifests(pair))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (workdir / "daemon.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "daemon", "--manifests", str(workdir / "manifests"),
                             "--state-dir", str(workdir / "state"), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited:\n{(workdir / 'daemon.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("daemon not ready")


def status(url: str, name: str) -> dict:
    with urllib.request.urlopen(f"{url}/apis/specd.dev/v1alpha1/models/{name}", timeout=10) as r:
        return json.loads(r.read())["status"]


def complete(client: openai.OpenAI, model: str, prompt: str, method: str, max_tokens: int) -> tuple[str, int]:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"speculation": {"method": method, "num_speculative_tokens": 3}})
    return reply.choices[0].text, reply.usage.completion_tokens


def parity(client: openai.OpenAI, max_tokens: int) -> dict:
    jobs = [(p, m) for p in PROMPTS for m in METHODS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        tp = list(pool.map(lambda j: complete(client, "tp", j[0], j[1], max_tokens), jobs))
        single = list(pool.map(lambda j: complete(client, "single", j[0], j[1], max_tokens), jobs))
    plain = {p: complete(client, "single", p, "none", max_tokens) for p in PROMPTS}
    same = [a == b == plain[p] for (p, _), a, b in zip(jobs, tp, single)]
    return {"requests": len(jobs), "identical": sum(same), "tokens": sum(n for _, n in tp)}


def per_token_ms(client: openai.OpenAI, model: str, method: str, max_tokens: int) -> float:
    """Wall time per generated token of one greedy stream, first token excluded."""
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"speculation": {"method": method, "num_speculative_tokens": 3}})
    first, tokens = None, 0
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return (time.perf_counter() - first) * 1e3 / max(1, tokens - 1)


def model_shape(target: Path) -> dict:
    config = json.loads((target / "config.json").read_text())
    return {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", type=Path, default=ROOT / "models/demo")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=ROOT / "ops/bench/results/tensor_parallel.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_daemon(Path(tmp), args.pair)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            for model in ("tp", "single"):
                complete(client, model, PROMPTS[0], "draft", 8)  # warm up
            check = parity(client, args.max_tokens)
            latency: dict[str, dict[str, float]] = {}
            for method in METHODS:
                for model in ("single", "tp"):  # alternate, so drift hits both alike
                    runs = [per_token_ms(client, model, method, args.max_tokens) for _ in range(args.runs)]
                    latency.setdefault(method, {})[model] = statistics.median(runs)
            time.sleep(1.1)  # the next status report from rank 0
            group = status(url, "tp")["group"]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    shape = model_shape(args.pair / "target")
    activations = 2 * shape["layers"] * shape["hidden"] * 4  # bytes all-reduced per token row per step
    control = group["controlBytes"] / max(1, group["steps"])
    result = {"parity": check, "per_token_ms": latency, "group": group, "shape": shape,
              "control_bytes_per_step": control, "allreduce_bytes_per_row_token": activations}
    print(f"greedy parity (mixed batches, {check['requests']} requests, {check['tokens']} tokens): "
          f"{check['identical']}/{check['requests']} identical")
    print(f"{'method':<8} {'single ms/tok':>14} {'2 ranks ms/tok':>15} {'ratio':>7}")
    for method, row in latency.items():
        print(f"{method:<8} {row['single']:>14.2f} {row['tp']:>15.2f} {row['tp'] / row['single']:>6.2f}x")
    print(f"control broadcast: {control:.0f} bytes per step on average ({group['steps']} steps)")
    print(f"all-reduce per step: {shape['layers']} layers x 2 all_sums x B x W x {shape['hidden']} float32 = "
          f"{activations} bytes per row-token ({activations / 1024:.1f} KiB); a single-stream plain step moves "
          f"{activations} bytes, a k=3 step of 8 rows {activations * 8 * 4 / 1024:.0f} KiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if check["identical"] == check["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
