#!/usr/bin/env python3
"""A cluster on this machine: replicas on two Nodes against one, and how the head routes.

Every Node is a worker daemon pinned to its own core (``taskset``), so two
Nodes really have twice the compute; the head (no room of its own,
``--memory-limit 1Mi``: it only places, tokenizes and routes) shares the last core.
The Model is the demo target, in one run:

1. **Throughput** at 8 concurrent greedy completions: 2 replicas on 2 Nodes
   against 1 replica on 1 Node, both through the head; tokens/s, median of
   ``--runs``, the two clusters running at once and taking turns run by run
   (after a warm-up run), and the ratio the median of the runs' ratios. Two
   workloads on the demo target: 128-token completions of short
   code prompts (completion tokens/s: decoding is the work), and agent-like
   requests, about 1,500 tokens of code each and 32-token replies (prompt and
   completion tokens/s: prefill is the work). With ``--big`` also decoding on a
   random-weight Llama of about 1 GB (32 tokens each). Eight requests on one
   replica decode as one batch of 8, on two as two batches of 4, so for decoding
   two replicas gain what a step at batch 8 costs over one at batch 4 (little:
   decoding is bound by reading the weights, on a Mac too); prefill's compute
   grows with its tokens, so there two replicas can double it.
2. **Multi-turn routing** over 2 replicas: 4 conversations at once, each with
   its own context (about 1,500 tokens of Python, a different file for each, as
   agents working on different code) and 6 turns (replies of
   16, 24, 32 and 40 tokens, so the conversations drift apart and their turns
   reach the head in changing order, as real clients' do), with the head's
   prefix-aware routing against round-robin: the prefix-cache hit rate of
   turns 2 to 6 (``cached_tokens`` over prompt tokens) and their median time
   to first token.
3. **Two replicas sharing one host** (``shared``): the demo workload of 1, with 2 Nodes
   against 1 but no daemon pinned, so the two Nodes share every core as two replicas on one
   Mac would share its GPU. It measures what two replicas on one Mac gain, run as an operator
   allows them (``docs/cluster.md``): two Nodes there.

4. **Tensor against pipeline parallelism over a link** (``--links``, root:
   network namespaces and ``tc``): the demo target on a 2-rank ring Topology,
   rank 1 in its own network namespace, one group per split, the link changed
   under the running groups; decode tokens/s of one stream and of 4 at once
   (128 tokens, greedy, plain decoding), against the same target in one
   process. Two sets of links:

   - bandwidth: a veth pair, bare and shaped to 1 Gbit/s by ``tc tbf`` at both ends;
   - latency (``delayed_link.py``): the ranks reach each other only through a
     relay that holds every chunk back by a one-way delay (this kernel has no
     ``netem``): 0 (the relay alone), 0.05, 0.25 and 1 ms.

   A tensor-parallel forward all-reduces twice per layer, a pipeline hands one
   hidden state down and gathers it once, so each ms of one-way latency costs the
   first about 4 x layers + 1 crossings a token and the second about 5 (fitted
   from the 1 ms setting, printed as ``crossings``); the faster split of each
   setting is what ``docs/tensor-parallel.md``'s rule picks. At each latency a
   group with ``parallelism: auto`` is started too, and the split it picks (it
   times a decode step under each as it starts) is printed beside the faster.
   With ``--big``, the latency settings run again with the random 1 GB model
   (one stream, 32 tokens), whose step is long enough for tensor parallelism to
   pay here, so ``auto`` has a real choice to make.

    specd forge models/test --preset test   # the tokenizer of the --big model
    python ops/bench/cluster.py [--runs 5] [--big] [--links] [--only throughput|multiturn|shared|links|latency]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from transformers import AutoTokenizer

from delayed_link import delayed_link, netns_rsh
from multiturn import chat_turns, conversation
from serve_vs_mlx_lm import child_env, free_port, stop_group
from spec_decode import machine_info, write_result
from specd.forge.families import build

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "ops" / "bench" / "results" / "cluster.json"
DEMO = REPO_ROOT / "models" / "demo" / "target"
ONE_GB = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
          "intermediate_size": 5632, "num_hidden_layers": 6, "max_position_embeddings": 4096}
TOKEN = "bench-cluster-token"


@contextlib.contextmanager
def daemon(home: Path, core: int | None, env: dict, *extra: str):
    """A specd daemon pinned to one core (None: any); yields its URL and its cluster port's (TLS)."""
    home.mkdir(parents=True)
    port, cluster_port = free_port(), free_port()
    argv = ([] if core is None else ["taskset", "-c", str(core)]) + [
        sys.executable, "-m", "specd.cli", "daemon", "--state-dir", str(home / "state"), "--host", "127.0.0.1",
        "--port", str(port), "--cluster-port", str(cluster_port), *extra]
    with open(home / "daemon.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", f"https://127.0.0.1:{cluster_port}"
    finally:
        stop_group(proc)


@contextlib.contextmanager
def cluster(workdir: Path, workers: int, routing: str, env: dict, pinned: bool = True):
    """A head and ``workers`` Nodes (worker i on core i; unless ``pinned`` is False: every daemon
    on every core, as Nodes sharing one host), the demo target with one replica each."""
    workdir.mkdir(parents=True)
    (workdir / "token").write_text(TOKEN)
    cores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        head, head_cluster = stack.enter_context(daemon(workdir / "head", cores - 1 if pinned else None, env,
                                                        "--cluster-token-file", str(workdir / "token"),
                                                        "--memory-limit", "1Mi", "--routing", routing))
        join_token = workdir / "head" / "state" / "cluster-join-token"  # the head writes it as it starts
        deadline = time.monotonic() + 120
        while not join_token.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the head wrote no {join_token}")
            time.sleep(0.1)
        for i in range(workers):
            stack.enter_context(daemon(workdir / f"w{i}", i % cores if pinned else None, env, "--join", head_cluster,
                                       "--token-file", str(join_token), "--node-name", f"w{i}"))
        yield head


async def until(check, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def serving(session: aiohttp.ClientSession, head: str, replicas: int, model: Path) -> None:
    """Apply the Model with ``replicas`` replicas once the Nodes joined; wait until every one is ready."""
    async def joined():
        try:
            async with session.get(f"{head}/apis/specd.dev/v1alpha1/nodes") as r:
                items = (await r.json())["items"]
        except aiohttp.ClientError:
            return False
        return sum(n["status"]["conditions"][0]["status"] == "True" for n in items) > replicas
    await until(joined, "Nodes")
    manifest = {"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": "demo"},
                "spec": {"source": str(model), "replicas": replicas}}
    async with session.post(f"{head}/apis/specd.dev/v1alpha1/apply", json={"items": [manifest]}) as r:
        r.raise_for_status()

    async def ready():
        async with session.get(f"{head}/apis/specd.dev/v1alpha1/models/demo") as r:
            return (await r.json()).get("status", {}).get("readyReplicas") == replicas
    await until(ready, "replicas")


async def completion(session: aiohttp.ClientSession, head: str, prompt: str, max_tokens: int) -> tuple[int, int]:
    """Prompt and completion tokens of one greedy completion."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with session.post(f"{head}/v1/completions", json=body) as r:
        r.raise_for_status()
        usage = (await r.json())["usage"]
        return usage["prompt_tokens"], usage["completion_tokens"]


def decode_prompts(run: int) -> list[str]:
    """8 short code prompts (about 100 tokens): the completions' decoding is the work. Each opens
    with its own line, so none shares a prefix with another or with an earlier run's."""
    source = (REPO_ROOT / "tests" / "data" / "speculation_sample.txt").read_text()
    starts = [(run * 8 + i) * 250 % (len(source) - 400) for i in range(8)]
    return [f"# session {run}-{i}\n" + source[s:s + 400] for i, s in enumerate(starts)]


def agent_prompts(run: int) -> list[str]:
    """8 agent-like prompts: about 1,500 tokens of code each, none sharing a prefix with
    another or with an earlier run's (each opens with its own line), so prefill is the work."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO))
    return [f"# session {run}-{i}\n" + contexts(tokenizer, 1500, i) for i in range(8)]


async def rates_taken_in_turn(workdir: Path, runs: int, env: dict, model: Path, max_tokens: int,
                              prompts=decode_prompts, counted: str = "completion", pinned: bool = True,
                              bound: bool = True) -> dict[str, list[float]]:
    """Tokens per second of 8 concurrent completions through 1 replica on 1 Node (``one``), of 4 of
    them there (``one_c4``, with ``bound``) and of 8 through 2 replicas on 2 Nodes (``two``), one
    rate of each per run: the completion tokens, or (``counted="all"``) prompt and completion tokens
    together. Both clusters run at once and take turns, run by run, after a first run of each that
    warms them up and is not counted, so this machine's slow and fast spells fall on both alike.
    Every batch's prompts are its own: no prefix cache holds them from another batch."""
    turns = [("one", 8), *([("one_c4", 4)] if bound else []), ("two", 8)]
    rates: dict[str, list[float]] = {key: [] for key, _ in turns}
    with (cluster(workdir / "one", 1, "prefix", env, pinned) as one,
          cluster(workdir / "two", 2, "prefix", env, pinned) as two):
        heads = {"one": one, "one_c4": one, "two": two}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await serving(session, one, 1, model)
            await serving(session, two, 2, model)
            for run in range(runs + 1):
                for i, (key, c) in enumerate(turns):
                    batch = prompts(run * len(turns) + i)[:c]
                    started = time.perf_counter()
                    usage = await asyncio.gather(*(completion(session, heads[key], p, max_tokens) for p in batch))
                    if run:
                        tokens = sum(n + (p if counted == "all" else 0) for p, n in usage)
                        rates[key].append(tokens / (time.perf_counter() - started))
    return rates


async def replicas_compared(workdir: Path, runs: int, env: dict, model: Path, max_tokens: int, **kw) -> dict:
    """2 replicas on 2 Nodes against 1 at 8 concurrent requests, and what 2 could gain at most here:
    twice what one Node does with 4 of them (each replica's share) over what it does with 8
    (``bound``). For decoding that is below 2x: a step at batch 8 costs little more than one at 4."""
    return compared(await rates_taken_in_turn(workdir, runs, env, model, max_tokens, **kw))


async def sharing_a_host(workdir: Path, runs: int, env: dict) -> dict:
    """Two replicas on one host: 2 Nodes against 1, every daemon free to run on every core (as two
    Nodes on one Mac would share its GPU), 8 concurrent 128-token completions: what two replicas on
    one Mac gain, run as two Nodes there."""
    return compared(await rates_taken_in_turn(workdir, runs, env, DEMO, 128, pinned=False, bound=False))


# What each end of the veth does to what it sends (a tc qdisc): bandwidth only. Latency is added by
# the relay of ``delayed_link.py`` (``splits_over_latency``): this kernel has no sch_netem.
LINKS = {"veth": None, "1 Gbit/s (tbf)": "tbf rate 1gbit burst 32kbit latency 50ms"}


@contextlib.contextmanager
def namespace_link(workdir: Path):
    """A second "host": a network namespace behind a veth pair (10.78.x.1 here, .2 there), and
    an rsh for the ssh launcher that runs a command in it. Yields (namespace, subnet, rsh, set_link)."""
    tag = os.getpid() % 250
    ns, here, there, subnet = f"specd-bench-{tag}", f"sdb{tag}a", f"sdb{tag}b", f"10.78.{tag}"
    rsh = netns_rsh(workdir)
    for cmd in (f"ip netns add {ns}", f"ip link add {here} type veth peer name {there}",
                f"ip link set {there} netns {ns}", f"ip addr add {subnet}.1/24 dev {here}", f"ip link set {here} up",
                f"ip netns exec {ns} ip addr add {subnet}.2/24 dev {there}",
                f"ip netns exec {ns} ip link set {there} up", f"ip netns exec {ns} ip link set lo up"):
        subprocess.run(cmd.split(), check=True, capture_output=True)

    def set_link(qdisc: str | None) -> None:
        """Both ends of the veth shape what they send with ``qdisc``; None: the bare veth."""
        for prefix, dev in (([], here), (["ip", "netns", "exec", ns], there)):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if qdisc:
                subprocess.run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", *qdisc.split()],
                               check=True, capture_output=True)
    try:
        yield ns, subnet, rsh, set_link
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def split_manifests(parallelism: str, ns: str, subnet: str, port: int, source: Path = DEMO) -> list[dict]:
    """A target (the demo's) on a 2-rank Topology across the link, and in one process."""
    topology = {"apiVersion": "specd.dev/v1alpha1", "kind": "Topology", "metadata": {"name": "link"},
                "spec": {"backend": "ring", "launcher": "ssh", "port": port, "threadsPerRank": 1,
                         "parallelism": parallelism, "stepTimeoutSeconds": 120,
                         "specdCommand": str(Path(sys.executable).with_name("specd")),
                         "hosts": [{"name": "here", "address": f"{subnet}.1"}, {"name": ns, "address": f"{subnet}.2"}]}}
    models = [{"apiVersion": "specd.dev/v1alpha1", "kind": "Model", "metadata": {"name": name},
               "spec": {"source": str(source), **extra}} for name, extra in (("demo", {"topologyRef": "link"}),
                                                                            ("single", {}))]
    return [topology, *models]


async def decode_rate(session: aiohttp.ClientSession, url: str, model: str, streams: int, runs: int,
                      max_tokens: int = 128) -> float:
    """Generated tokens per second of ``streams`` concurrent greedy completions, median of ``runs``."""
    source = (REPO_ROOT / "tests" / "data" / "speculation_sample.txt").read_text()

    async def one(prompt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "speculation": {"method": "none"}}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            return (await r.json())["usage"]["completion_tokens"]
    rates = []
    for run in range(runs):
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(source[(run * 4 + i) * 300:(run * 4 + i) * 300 + 300])
                                        for i in range(streams)))
        rates.append(sum(tokens) / (time.perf_counter() - started))
    return statistics.median(rates)


@contextlib.asynccontextmanager
async def split_group(home: Path, parallelism: str, ns: str, subnet: str, rsh: Path, port: int, env: dict,
                      source: Path = DEMO):
    """A daemon serving a target (the demo's) split over a 2-rank ring across the link (``demo``) and
    in one process (``single``); yields a session and its URL once both are ready."""
    (home / "manifests").mkdir(parents=True)
    (home / "manifests" / "link.yaml").write_text(
        "\n---\n".join(json.dumps(d) for d in split_manifests(parallelism, ns, subnet, port, source)))
    # not pinned: its ranks inherit its CPU affinity, and each needs a core of its own
    with daemon(home / "d", None, {**env, "SPECD_RSH": str(rsh)}, "--manifests", str(home / "manifests")) as (url, _):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            async def ready():
                try:
                    async with session.get(f"{url}/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            try:
                await until(ready, f"the {parallelism} group")
            except RuntimeError:
                print((home / "d" / "daemon.log").read_text()[-3000:], file=sys.stderr)
                raise
            yield session, url


async def rates(session: aiohttp.ClientSession, url: str, model: str, runs: int, streams: tuple[int, ...] = (1, 4),
                max_tokens: int = 128) -> dict:
    await decode_rate(session, url, model, 1, 1, max_tokens)  # warm-up on this link
    return {f"c{c}": await decode_rate(session, url, model, c, runs, max_tokens) for c in streams}


async def splits_over_links(workdir: Path, runs: int, env: dict) -> dict:
    """tokens/s per link and split (and in one process), one group per split."""
    out: dict = {}
    with namespace_link(workdir) as (ns, subnet, rsh, set_link):
        for parallelism in ("tensor", "pipeline"):
            port = 41000 + (os.getpid() % 1000) * 4 + (parallelism == "pipeline") * 2
            set_link(None)
            async with split_group(workdir / parallelism, parallelism, ns, subnet, rsh, port, env) as (session, url):
                for link, qdisc in LINKS.items():
                    set_link(qdisc)
                    cell = out.setdefault(link, {})
                    cell[parallelism] = await rates(session, url, "demo", runs)
                    if parallelism == "tensor":
                        cell["one process"] = await rates(session, url, "single", runs)
            set_link(None)
    return out


# One-way latencies added by the relay (``delayed_link.py``): 0 (the relay alone), about what IP over
# Thunderbolt adds, a switched Ethernet LAN, and a slow or wireless one.
LATENCIES_MS = {"relay only": 0.0, "Thunderbolt-like, 0.05 ms": 0.05, "Ethernet-like, 0.25 ms": 0.25,
                "slow LAN, 1 ms": 1.0}


async def splits_over_latency(workdir: Path, runs: int, env: dict, source: Path = DEMO, streams=(1, 4),
                              max_tokens: int = 128) -> dict:
    """tokens/s per one-way latency and split (and in one process), one group per split; and the split
    a ``parallelism: auto`` group started at each latency picks."""
    out: dict = {}
    base = 43000 + (os.getpid() % 500) * 8
    ports = {"tensor": base, "pipeline": base + 2, "auto": base + 4}
    with delayed_link(workdir, [(p, p + 1) for p in ports.values()]) as link:
        for parallelism in ("tensor", "pipeline"):
            link.set_delay(0)
            async with split_group(workdir / parallelism, parallelism, link.ns, link.subnet, link.rsh,
                                   ports[parallelism], env, source) as (session, url):
                for setting, ms in LATENCIES_MS.items():
                    link.set_delay(ms)
                    cell = out.setdefault(setting, {})
                    cell[parallelism] = await rates(session, url, "demo", runs, streams, max_tokens)
                    if parallelism == "tensor" and ms == 0:
                        cell["one process"] = await rates(session, url, "single", runs, streams, max_tokens)
        for setting, ms in LATENCIES_MS.items():  # auto chooses as its group starts: one group per setting
            link.set_delay(ms)
            async with split_group(workdir / f"auto-{ms}", "auto", link.ns, link.subnet, link.rsh, ports["auto"],
                                   env, source) as (session, url):
                async with session.get(f"{url}/apis/specd.dev/v1alpha1/models/demo") as r:
                    group = (await r.json())["status"]["group"]
            out[setting]["auto"] = {"picks": group["parallelism"],
                                    "step_ms": group["splitProbe"]["stepMilliseconds"]}
    for cell in out.values():
        cell["faster"] = max(("tensor", "pipeline"), key=lambda split: cell[split]["c1"])
    if source != DEMO:  # a step of 100 ms or more hides a few ms of latency in its noise: nothing to fit
        return out
    slowest, bare = out[max(LATENCIES_MS, key=LATENCIES_MS.get)], out[min(LATENCIES_MS, key=LATENCIES_MS.get)]
    # each one-way crossing of the link a token waits for costs it the added latency once
    out["crossings_per_token"] = {
        split: (1 / slowest[split]["c1"] - 1 / bare[split]["c1"]) / (max(LATENCIES_MS.values()) / 1000)
        for split in ("tensor", "pipeline")}
    return out


def compared(rates: dict[str, list[float]]) -> dict:
    """Medians of each configuration's rates; ``ratio`` and ``bound``: medians over runs of what each
    run measured (2 replicas over 1, twice 1 at c=4 over 1 at c=8)."""
    one, two = rates["one"], rates["two"]
    out = {"one_node_tok_s": statistics.median(one), "two_nodes_tok_s": statistics.median(two),
           "ratio": statistics.median(b / a for a, b in zip(one, two)),
           "ratio_of_medians": statistics.median(two) / statistics.median(one), "raw": rates}
    if "one_c4" in rates:
        out["one_node_c4_tok_s"] = statistics.median(rates["one_c4"])
        out["bound"] = statistics.median(2 * c / a for a, c in zip(one, rates["one_c4"]))
    return out


def contexts(tokenizer, tokens: int, index: int) -> str:
    """About ``tokens`` tokens of one of the standard library's modules, a different one per ``index``."""
    import inspect
    import json.decoder
    import json.encoder
    import statistics as stats
    import textwrap as wrap
    module = (json.decoder, json.encoder, stats, wrap)[index % 4]
    ids = tokenizer.encode(inspect.getsource(module))[:tokens]
    return f"You are a code assistant. The code under discussion ({module.__name__}):\n" + tokenizer.decode(ids)


async def multiturn(workdir: Path, routing: str, runs: int, env: dict) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO))
    systems = [contexts(tokenizer, 1500, c) for c in range(4)]
    ttfts, cached, prompt = [], 0, 0
    with cluster(workdir, 2, routing, env) as head:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await serving(session, head, 2, DEMO)
            for run in range(runs):
                done = await asyncio.gather(*(conversation(session, head, "demo", systems[c], chat_turns(run, c),
                                                           16 + 8 * c) for c in range(4)))
                for conv in done:
                    for t in conv["turns"][1:]:
                        ttfts.append(t["ttft_s"])
                        cached += t["cached_tokens"] or 0
                        prompt += t["prompt_tokens"] or 0
    return {"hit_rate": cached / prompt, "later_turn_ttft_s": statistics.median(ttfts)}


async def bench(args: argparse.Namespace, workdir: Path) -> dict:
    env, _ = child_env()
    parts = set(args.only or ("throughput", "multiturn", "shared", *(["links", "latency"] if args.links else [])))
    out: dict = {}
    if "throughput" in parts:
        out["throughput_c8"] = {
            "demo": await replicas_compared(workdir / "demo", args.runs, env, DEMO, 128),
            "demo, agent-like": await replicas_compared(workdir / "agent", args.runs, env, DEMO, 32,
                                                        prompts=agent_prompts, counted="all")}
        if args.big:
            out["throughput_c8"]["random 1 GB"] = await replicas_compared(workdir / "big", args.runs, env,
                                                                          one_gb(workdir), 32)
    if "shared" in parts:
        out["one_host_c8"] = await sharing_a_host(workdir / "shared", args.runs, env)
    if "multiturn" in parts:
        out["multiturn_c4"] = {"prefix": await multiturn(workdir / "prefix", "prefix", args.runs, env),
                               "round-robin": await multiturn(workdir / "rr", "round-robin", args.runs, env)}
    if "links" in parts:
        out["splits_over_links"] = await splits_over_links(workdir / "links", args.runs, env)
    if "latency" in parts:
        out["splits_over_latency"] = await splits_over_latency(workdir / "latency", args.runs, env)
        if args.big:  # a model whose step is long enough for tensor parallelism to pay here
            out["splits_over_latency, random 1 GB"] = await splits_over_latency(
                workdir / "latency-big", args.runs, env, one_gb(workdir), (1,), 32)
    return out


def one_gb(workdir: Path) -> Path:
    """The random 1 GB Llama (built once per run)."""
    path = workdir / "one-gb"
    if not path.exists():
        build("llama", path, REPO_ROOT / "models" / "test" / "target", overrides=ONE_GB)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--big", action="store_true",
                        help="also a random 1 GB model: its throughput, and (with latency) its splits")
    parser.add_argument("--links", action="store_true",
                        help="also tensor against pipeline parallelism over slowed links and added latency (root: netns, tc)")
    parser.add_argument("--only", action="append", choices=("throughput", "multiturn", "shared", "links", "latency"),
                        help="only this part (repeatable)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(bench(args, Path(tmp)))
    for model, t in results.get("throughput_c8", {}).items():
        print(f"{model}, c=8 tok/s: 1 replica on 1 Node {t['one_node_tok_s']:.1f}, 2 replicas on 2 Nodes "
              f"{t['two_nodes_tok_s']:.1f}: {t['ratio']:.2f}x, runs paired (at most {t['bound']:.2f}x: 1 Node "
              f"at c=4 {t['one_node_c4_tok_s']:.1f}, twice)")
    if "one_host_c8" in results:
        t = results["one_host_c8"]
        print(f"demo, c=8 tok/s on one host's cores: 1 Node {t['one_node_tok_s']:.1f}, 2 Nodes "
              f"{t['two_nodes_tok_s']:.1f}: {t['ratio']:.2f}x")
    for routing, r in results.get("multiturn_c4", {}).items():
        print(f"multi-turn c=4, {routing:>11}: hit rate {r['hit_rate']:.2f}, later-turn TTFT "
              f"{1000 * r['later_turn_ttft_s']:.0f} ms")
    for part in ("splits_over_links", "splits_over_latency", "splits_over_latency, random 1 GB"):
        cells = dict(results.get(part, {}))
        crossings = cells.pop("crossings_per_token", None)
        if cells:
            print(part)
        for link, cell in cells.items():
            print(f"{link:>26}: " + "; ".join(f"{split} " + ", ".join(f"c={c[1:]} {r[c]:.1f}" for c in r) + " tok/s"
                                              for split, r in cell.items() if split not in ("faster", "auto"))
                  + (f"; faster: {cell['faster']}" if "faster" in cell else "")
                  + (f"; auto picks {cell['auto']['picks']} (timed step, ms: "
                     + ", ".join(f"{s} {t:.2f}" for s, t in cell["auto"]["step_ms"].items()) + ")"
                     if "auto" in cell else ""))
        if crossings:
            print("link crossings a token waits for: " + ", ".join(f"{k} {v:.1f}" for k, v in crossings.items()))
    write_result(args.out, {**machine_info(args), "results": results})
    print(json.dumps({m: round(t["ratio"], 3) for m, t in results.get("throughput_c8", {}).items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
