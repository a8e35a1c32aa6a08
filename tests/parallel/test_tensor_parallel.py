"""Tensor parallelism: a Model placed on a 2-rank ring Topology on loopback.

Real ``specd rank`` processes joined by ``mx.distributed``'s ring backend,
driven through the daemon with the openai client, against the same forged
target served by a single process in the same daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import mlx_lm
import openai
import pytest
from conftest import model_manifest, run_engine, start_daemon
from daemons import model_status, topology, wait_for

from specd.api.manifest import SPEC_PARSERS
from specd.core.grammar import json_schema_grammar
from specd.core.request import NO_SPECULATION, GenerationRequest
from specd.core.sampling import SamplingParams
from specd.parallel import wire
from specd.parallel.group import GroupClient
from specd.parallel.topology import group_ports, mlx_environment

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [1, 2, 3]\n", "def main():\n    args = parse()\n"]
METHODS = ["none", "ngram", "draft"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "size"], "additionalProperties": False}


def pairing(target: str, draft) -> str:
    return textwrap.dedent(f"""\
        apiVersion: specd.dev/v1alpha1
        kind: DraftPairing
        metadata:
          name: {target}-draft
        spec:
          targetRef: {target}
          method: draft
          source: {draft}
          numSpeculativeTokens: 3
        """)


@pytest.fixture(scope="module")
def tp(forged, tmp_path_factory):
    """A daemon serving the forged target twice: ``single`` in-process and ``tp`` on two ranks."""
    docs = [topology(stepTimeoutSeconds=5),
            model_manifest("tp", forged / "target", topologyRef="loopback", maxBatchSize=8),
            model_manifest("single", forged / "target", maxBatchSize=8),
            pairing("tp", forged / "draft"), pairing("single", forged / "draft")]
    daemon = start_daemon(tmp_path_factory.mktemp("tp"), {"models.yaml": "---\n".join(docs)})
    yield daemon
    daemon.stop()


@pytest.fixture(autouse=True)
def group_ready(request):
    """Every test on the shared daemon starts with its group Ready: a test that
    broke the group (or failed before it came back) must not hand the next one
    a group still restarting."""
    if "tp" in request.fixturenames:
        wait_ready(request.getfixturevalue("tp"), "tp")


def wait_ready(daemon, name: str, timeout: float = 90) -> dict:
    """The model's status once it serves: Ready, not Degraded, and every rank alive."""
    deadline = time.monotonic() + timeout
    while True:
        status = model_status(daemon, name)
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        ranks = status.get("group", {}).get("ranks", [])
        if status.get("phase") == "Ready" and conditions.get("Degraded") == "False" and ranks \
                and all(_alive(r["pid"]) for r in ranks):
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"{name} is not Ready after {timeout:g}s: {status}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def client_for(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, model: str, prompt: str, method: str, max_tokens: int = 40):
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"speculation": {"method": method, "num_speculative_tokens": 3}})
    return reply.choices[0].text, reply.usage.completion_tokens


def test_ring_hostfile_and_jaccl_devices_from_topology():
    ring = SPEC_PARSERS["Topology"]({"backend": "ring", "hosts": [
        {"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"}]})
    assert json.loads(mlx_environment(ring, [5000, 5001])["SPECD_MLX_HOSTFILE"]) == [
        ["10.0.0.1:5000"], ["10.0.0.2:5001"]]
    jaccl = SPEC_PARSERS["Topology"]({"backend": "jaccl", "hosts": [
        {"name": "a", "address": "10.0.0.1", "rdmaDevices": {"b": "rdma_en3"}},
        {"name": "b", "address": "10.0.0.2", "rdmaDevices": {"a": "rdma_en4"}}]})
    env = mlx_environment(jaccl, [5000, 5001])
    assert json.loads(env["SPECD_MLX_IBV_DEVICES"]) == [[None, "rdma_en3"], ["rdma_en4", None]]
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5000"


def test_greedy_output_matches_single_process_in_mixed_batches(tp):
    """Every prompt with every method, all at once against both models: the
    two-rank group's batches mix plain, n-gram and draft rows."""
    client = client_for(tp)
    status = model_status(tp, "tp")
    assert [r["rank"] for r in status["group"]["ranks"]] == [0, 1]
    jobs = [(p, m) for p in PROMPTS for m in METHODS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        on_tp = list(pool.map(lambda j: complete(client, "tp", *j), jobs))
        alone = list(pool.map(lambda j: complete(client, "single", *j), jobs))
    baseline = {p: complete(client, "single", p, "none") for p in PROMPTS}
    for (prompt, method), got, ref in zip(jobs, on_tp, alone):
        assert got == ref == baseline[prompt], (prompt, method)


def speculation_report(client, model: str, method: str) -> tuple[str, dict]:
    """The text and speculation report of a greedy completion that repeats itself (so proposals match)."""
    reply = client.completions.create(model=model, prompt=PROMPTS[0] * 3, max_tokens=32, temperature=0,
                                      extra_body={"speculation": {"method": method}})
    return reply.choices[0].text, reply.usage.model_extra["speculation"]


def assert_speculates_as_single(client, model: str) -> None:
    """The text ``single`` writes, n-gram and draft alike, and both speculate with the method
    asked. How many tokens a round proposes is each engine's own choice (the k asked is a
    ceiling the cost model shortens from timed steps; a group's ranks take rank 0's), so
    the counts may differ from one process to another, never the tokens."""
    for method in ("ngram", "draft"):
        (text, report), (single_text, single) = (speculation_report(client, m, method) for m in (model, "single"))
        assert text == single_text
        assert report["method"] == single["method"] == method
        assert report["rounds"] > 0 and single["rounds"] > 0
        assert 0 < report["draft_tokens"] and report["accepted_tokens"] <= report["draft_tokens"]


def test_group_speculates_as_a_single_process(tp):
    """The ranks speculate, and write what the single engine writes."""
    assert_speculates_as_single(client_for(tp), "tp")


def test_structured_output_on_a_group_matches_a_single_process(tp):
    """Every rank builds the request's grammar and masks alike: the group's
    json_schema output is the single engine's, speculating or not."""
    client = client_for(tp)
    for method in METHODS:
        replies = [client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=48, temperature=0,
            extra_body={"speculation": {"method": method},
                        "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}})
            for model in ("tp", "single")]
        assert replies[0].choices[0].text == replies[1].choices[0].text, method
        assert set(json.loads(replies[0].choices[0].text)) == {"name", "size"}


SKEWED_RANK = """
import json, os, sys, threading
from types import SimpleNamespace
from specd.core.grammar import json_schema_grammar
from specd.core.request import GenerationRequest
from specd.core.sampling import SamplingParams
from specd.parallel.rank import GroupRank, _join_group
from specd.parallel.shard import load_shard
from specd.engine.engine import Engine
from specd.engine.scheduler import EngineConfig

args = json.loads(sys.argv[1])
group = _join_group(SimpleNamespace(env=args["env"], backend="ring"))
rank = group.rank()
model, tokenizer, _ = load_shard(args["target"], None, group, "tensor")
engine = Engine("g", model, tokenizer, EngineConfig(max_batch_size=2))
costs = engine.scheduler.speculator.feedback.costs
for width in range(2, 64):  # rank 0 measured wide verify steps as free, rank 1 as dear
    costs.observe_target(1, width, 1e-3 if rank == 0 else 1.0)
costs.observe_target(1, 1, 1e-3)
stepper = GroupRank(engine, group)
if rank == 0:
    tokens, done = [], threading.Event()
    def emit(out):
        tokens.extend(out.tokens)
        if out.finish_reason:
            done.set()
    request = GenerationRequest("r", tokenizer.encode(args["prompt"]), SamplingParams(temperature=0),
                                48, grammar=json_schema_grammar(args["schema"]))
    engine.submit(request, emit)
    stepping = threading.Thread(target=stepper.run_steps)
    stepping.start()
    done.wait(60)
    engine.stop()
    stepping.join(30)
    forced = engine.metrics.grammar_forced_tokens.labels("g")._value.get()
    print(json.dumps({"tokens": tokens, "forced": forced}), flush=True)
else:
    stepper.run_steps()
sys.stdout.flush()
os._exit(0)
"""


def test_ranks_jump_forward_alike_whatever_their_own_timings(forged, tmp_path):
    """How many forced tokens a step verifies is chosen from timed costs, which
    differ between ranks: rank 0's choice is broadcast, so ranks whose cost
    models disagree (rank 1 finds wide steps dear) still run the same forward.
    The hostfile each rank wrote to join the group is gone once it joined, and so is
    what a rank killed as it joined left behind; a running one's is kept."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = {pid: tmp_path / f"specd-rank-{pid}-x1y2" for pid in (int(gone.stdout), os.getpid())}
    for path in left.values():
        path.mkdir()
        (path / "mlx_hostfile").write_text("[]")
    topo = SPEC_PARSERS["Topology"]({"backend": "ring", "hosts": [
        {"name": f"rank{r}", "address": "127.0.0.1"} for r in range(2)]})
    env = mlx_environment(topo, group_ports(topo))
    args = json.dumps({"env": env, "target": str(forged / "target"), "prompt": PROMPTS[0], "schema": SCHEMA})
    ranks = [subprocess.Popen([sys.executable, "-c", SKEWED_RANK, args], stdout=subprocess.PIPE,
                              env={**os.environ, "MLX_RANK": str(r), "MLX_WORLD_SIZE": "2",
                                   "TMPDIR": str(tmp_path)},
                              start_new_session=True) for r in range(2)]
    try:
        outs = [proc.communicate(timeout=120)[0] for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert [proc.returncode for proc in ranks] == [0, 0]
    assert list(tmp_path.glob("specd-rank-*")) == [left[os.getpid()]]  # (MLX keeps its compiled kernels there too)
    group = json.loads(outs[0])

    model, tokenizer = mlx_lm.load(str(forged / "target"))

    async def alone(engine):
        request = GenerationRequest("r", tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0),
                                    48, grammar=json_schema_grammar(SCHEMA))
        return [t for out in [o async for o in engine.generate(request)] for t in out.tokens]

    assert group["forced"] > 0
    assert group["tokens"] == run_engine(model, tokenizer, alone)


def test_goodput_policy_reaches_the_ranks_and_keeps_them_in_step(tp):
    """A goodput SpecPolicy chooses k from timings that differ between ranks;
    rank 0's choice is broadcast, so output still matches a single process."""
    policy = {"apiVersion": "specd.dev/v1alpha1", "kind": "SpecPolicy", "metadata": {"name": "adaptive"},
              "spec": {"selector": {"matchLabels": {}}, "mode": "goodput", "maxSpeculativeTokens": 4}}
    req = urllib.request.Request(f"{tp.url}/apis/specd.dev/v1alpha1/apply", method="POST",
                                 data=json.dumps({"items": [policy]}).encode())
    urllib.request.urlopen(req, timeout=10).read()
    deadline = time.monotonic() + 30
    while model_status(tp, "tp").get("specPolicy", {}).get("name") != "adaptive":
        assert time.monotonic() < deadline, model_status(tp, "tp")
        time.sleep(0.1)
    client = client_for(tp)
    try:
        jobs = [(p, m) for p in PROMPTS for m in ("ngram", "draft")]
        with ThreadPoolExecutor(len(jobs)) as pool:
            on_tp = list(pool.map(lambda j: complete(client, "tp", *j), jobs))
        for (prompt, _), got in zip(jobs, on_tp):
            assert got == complete(client, "single", prompt, "none")
    finally:
        urllib.request.urlopen(urllib.request.Request(
            f"{tp.url}/apis/specd.dev/v1alpha1/specpolicies/adaptive", method="DELETE"), timeout=10).read()


def test_group_series_are_on_the_daemons_metrics_page(tp):
    """Rank 0's engine metrics reach ``/metrics`` under the model's name, one family each."""
    from prometheus_client.parser import text_string_to_metric_families

    complete(client_for(tp), "tp", PROMPTS[2], "draft")
    time.sleep(1.2)  # rank 0 reports every 0.5 s
    _, body = tp.get("/metrics")
    families = list(text_string_to_metric_families(body.decode()))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    samples = {(s.name, s.labels.get("model_name")): s.value for f in families for s in f.samples
               if s.labels.get("finished_reason") == "length" or s.name.startswith("specd_spec_decode_num_drafts")}
    assert samples[("specd_request_success_total", "tp")] >= 1
    assert samples[("specd_spec_decode_num_drafts_total", "tp")] >= 1


def test_an_idle_group_is_not_mistaken_for_a_hung_one(tp):
    """No steps while idle is not a hang: a request after a pause longer than the step timeout works."""
    client = client_for(tp)
    complete(client, "tp", PROMPTS[5], "none")
    restarts = model_status(tp, "tp")["group"]["restarts"]
    time.sleep(6)  # stepTimeoutSeconds is 5
    # long enough (hundreds of steps) for the hang watch to look while it runs
    assert complete(client, "tp", PROMPTS[5], "draft", 400) == complete(client, "single", PROMPTS[5], "none", 400)
    assert model_status(tp, "tp")["group"]["restarts"] == restarts


def _ranks_of(daemon_pid: int) -> list[int]:
    """The daemon's rank processes (its children started with a group plan), by rank."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != daemon_pid:
                continue
            env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in v)
        except OSError:
            continue
        if "SPECD_GROUP" in env:
            found[int(env["MLX_RANK"])] = int(proc.name)
    return [found[r] for r in sorted(found)]


def test_ranks_leave_when_the_daemon_is_killed_mid_start(forged, tmp_path):
    """The daemon is SIGKILLed while its group starts (rank 1 held stopped, so rank 0 waits for it
    in the group's join): both ranks leave, on the end of the stdin the daemon held open, rather
    than waiting forever for a peer or a daemon that is gone."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("finds the ranks through /proc")
    docs = [topology(), model_manifest("tp", forged / "target", topologyRef="loopback")]
    daemon = start_daemon(tmp_path, {"models.yaml": "---\n".join(docs)}, False)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(ranks) < 2:
            assert time.monotonic() < deadline, "the group's ranks never started"
            ranks = _ranks_of(daemon.proc.pid)
            time.sleep(0.02)
        os.kill(ranks[1], signal.SIGSTOP)
    finally:
        daemon.stop(signal.SIGKILL)
    try:
        wait_for(lambda: not _alive(ranks[0]), 30, "rank 0 to leave with the daemon")
    finally:
        with contextlib.suppress(ProcessLookupError):  # its own lifeline may have killed it already
            os.kill(ranks[1], signal.SIGCONT)
    wait_for(lambda: not _alive(ranks[1]), 30, "rank 1 to leave with the daemon")


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_fails_the_stream_then_the_group_restarts(tp, victim):
    """The error names the killed rank, whichever rank notices first (the
    survivor also exits, on its lost ring connection)."""
    client = client_for(tp)
    status = model_status(tp, "tp")
    restarts, ranks = status["group"]["restarts"], status["group"]["ranks"]
    stream = client.completions.create(model="tp", prompt=PROMPTS[1], max_tokens=400, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    os.kill(ranks[victim]["pid"], signal.SIGKILL)
    with pytest.raises(openai.APIError) as err:
        for _ in chunks:
            pass
    assert f"rank {victim} (rank{victim}) exited with signal SIGKILL" in str(err.value)

    deadline = time.monotonic() + 60
    seen_degraded = False
    while time.monotonic() < deadline:
        status = model_status(tp, "tp")
        conditions = {c["type"]: c for c in status["conditions"]}
        if conditions["Degraded"]["status"] == "True":
            seen_degraded = True
            assert conditions["Degraded"]["reason"] == "GroupFailed"
            assert "SIGKILL" in conditions["Degraded"]["message"]
        if conditions["Ready"]["status"] == "True" and status["group"]["restarts"] == restarts + 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"group did not come back: {status}")
    assert "SIGKILL" in status["group"]["lastFailure"]
    assert {r["pid"] for r in status["group"]["ranks"]}.isdisjoint(r["pid"] for r in ranks)
    assert seen_degraded or "SIGKILL" in conditions["Degraded"]["message"]
    text, _ = complete(client, "tp", PROMPTS[0], "draft")
    assert text == complete(client, "single", PROMPTS[0], "none")[0]


def test_hung_rank_fails_the_group_after_the_step_timeout(tp):
    """A rank that stops answering (SIGSTOP) is found by the step timeout, not by its exit."""
    client = client_for(tp)
    status = model_status(tp, "tp")
    restarts, ranks = status["group"]["restarts"], status["group"]["ranks"]
    stream = client.completions.create(model="tp", prompt=PROMPTS[3], max_tokens=400, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    os.kill(ranks[1]["pid"], signal.SIGSTOP)
    try:
        with pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks[1]["pid"], signal.SIGCONT)
    assert "no engine step finished in 5s" in str(err.value)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = model_status(tp, "tp")
        if status["group"]["restarts"] == restarts + 1 and status["phase"] == "Ready":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"group did not come back: {status}")
    assert complete(client, "tp", PROMPTS[4], "ngram") == complete(client, "single", PROMPTS[4], "none")


PEER_LOST = "RuntimeError: [ring] connection to a peer was lost"


def group_failure(events: list, ranks: int = 2) -> str:
    """The reason a GroupClient fails with when its stand-in ranks (shells the test
    ends as it likes) go in the order ``events`` gives: ("fatal", error) is rank 0's
    report, ("exit", rank, code or signal) a rank's end, ("sleep", s) a pause."""
    procs = [subprocess.Popen(["sh", "-c", "read code; exit $code"], stdin=subprocess.PIPE,
                              start_new_session=True) for _ in range(ranks)]
    topo = SPEC_PARSERS["Topology"]({"backend": "ring", "hosts": [
        {"name": f"rank{r}", "address": "127.0.0.1"} for r in range(ranks)]})
    writer = SimpleNamespace(is_closing=lambda: True, close=lambda: None, write=lambda data: None)
    info = {"max_context": 64, "vocab_size": 64, "drafter": None, "weight_bytes": 0, "parallelism": "tensor",
            "probe": None}

    async def play() -> str:
        group = GroupClient(name="g", topology=topo, procs=procs, tokenizer=None, info=info,
                            speculation=NO_SPECULATION, on_failure=lambda: None,
                            reader=asyncio.StreamReader(), writer=writer)
        group.start()
        for event in events:
            if event[0] == "fatal":
                group._reader.feed_data(wire.encode(("fatal", event[1])))
            elif event[0] == "exit":
                end_rank(procs[event[1]], event[2])
            else:
                await asyncio.sleep(event[1])
        deadline = time.monotonic() + 60
        while group.failure is None:
            assert time.monotonic() < deadline, "the group never failed"
            await asyncio.sleep(0.05)
        for task in group._tasks:
            task.cancel()
        return group.failure

    try:
        return asyncio.run(play())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdin.close()


def end_rank(proc: subprocess.Popen, how: int) -> None:
    """End a stand-in rank with a signal (a ``signal.Signals``) or an exit code, and wait for it."""
    if isinstance(how, signal.Signals):
        proc.send_signal(how)
    else:
        proc.stdin.write(f"{how}\n".encode())
        proc.stdin.flush()
    proc.wait()


@pytest.mark.parametrize("rank_0", [["exit"], ["fatal"], ["fatal", "exit"], ["exit", "fatal"]])
def test_failure_names_the_killed_rank_though_rank_0_noticed_first(rank_0):
    """Rank 1 is killed; rank 0 reports the lost peer and exits before the daemon
    can see rank 1 gone (its signal shows 0.5 s later): rank 1 is named."""
    first = {"exit": ("exit", 0, 1), "fatal": ("fatal", PEER_LOST)}
    reason = group_failure([*(first[e] for e in rank_0), ("sleep", 0.5), ("exit", 1, signal.SIGKILL)])
    rank_0_said = f" (rank 0: {PEER_LOST})" if "fatal" in rank_0 else ""
    assert reason == f"rank 1 (rank1) exited with signal SIGKILL{rank_0_said}"


@pytest.mark.parametrize("fatal, culprit", [
    (PEER_LOST, "rank 1 (rank1) exited with exit code 3"),
    ("ValueError: bad request state", "rank 0 (rank0) exited with exit code 1"),
])
def test_failure_names_the_rank_whose_error_was_its_own(fatal, culprit):
    """Both ranks exit with codes, rank 0 first: a rank 0 that only lost its peer is
    not the cause (rank 1's own error is), but a rank 0 that failed on its own is."""
    reason = group_failure([("fatal", fatal), ("exit", 0, 1), ("sleep", 0.3), ("exit", 1, 3)])
    assert reason == f"{culprit} (rank 0: {fatal})"


def test_rank_0_losing_a_peer_that_never_exits_says_so():
    """Rank 0 lost its peer, but no other rank is seen to go within the grace: no exit to blame."""
    assert group_failure([("fatal", PEER_LOST), ("exit", 0, 1)]) == f"rank 0 stopped the group: {PEER_LOST}"


@pytest.mark.parametrize("parallelism", ["tensor", "pipeline", "auto"])
def test_two_hosts_in_network_namespaces_match_a_single_process(forged, tmp_path_factory, netns_hosts, parallelism):
    """Rank 1 in its own network namespace, reached over a veth link and started
    through the ssh launcher (``SPECD_RSH``): same greedy tokens as one process,
    the ranks splitting every layer or the stack of layers, or (auto) whichever of
    the two decoded faster over that link as the group started."""
    ns, subnet, rsh = netns_hosts.ns, netns_hosts.subnet, netns_hosts.rsh
    specd = Path(sys.executable).with_name("specd")
    topo = textwrap.dedent(f"""\
        apiVersion: specd.dev/v1alpha1
        kind: Topology
        metadata:
          name: veth
        spec:
          backend: ring
          launcher: ssh
          port: {40000 + os.getpid() % 20000 + 2 * ["tensor", "pipeline", "auto"].index(parallelism)}
          threadsPerRank: 1
          parallelism: {parallelism}
          specdCommand: {specd}
          hosts:
            - {{name: here, address: {subnet}.1}}
            - {{name: {ns}, address: {subnet}.2}}
        """)
    docs = [topo, model_manifest("tp2", forged / "target", topologyRef="veth"),
            model_manifest("single", forged / "target"), pairing("tp2", forged / "draft"),
            pairing("single", forged / "draft")]
    os.environ["SPECD_RSH"] = str(rsh)
    try:
        daemon = start_daemon(tmp_path_factory.mktemp("netns"), {"models.yaml": "---\n".join(docs)})
    finally:
        del os.environ["SPECD_RSH"]
    try:
        client = client_for(daemon)
        jobs = [(p, m) for p in PROMPTS[:3] for m in METHODS]
        with ThreadPoolExecutor(len(jobs)) as pool:
            on_tp = list(pool.map(lambda j: complete(client, "tp2", *j), jobs))
        for (prompt, method), got in zip(jobs, on_tp):
            assert got == complete(client, "single", prompt, "none"), (prompt, method)
        group = model_status(daemon, "tp2")["group"]
        assert [r["host"] for r in group["ranks"]] == ["here", ns]
        timed = (group.get("splitProbe") or {}).get("stepMilliseconds", {})
        assert group["parallelism"] == (min(timed, key=timed.get) if parallelism == "auto" else parallelism)
        assert set(timed) == ({"tensor", "pipeline"} if parallelism == "auto" else set())
    finally:
        daemon.stop()
