"""Operations: the Prometheus config and rules, the Grafana dashboard, and the metrics they use.

A daemon with a draft-paired model and a policy-disabled, easily overloaded one
takes plain, streaming and speculative traffic.  Then every metric an alert,
recording rule or dashboard panel names must be among the samples /metrics
exports; promtool must accept the config and the rules (and the rules' unit
tests); and a real Prometheus scraping the daemon must evaluate every rule
cleanly and answer every dashboard query with data.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml
from conftest import ROOT, free_port, model_manifest, start_daemon
from prometheus_client.parser import text_string_to_metric_families

PROMETHEUS_DIR = ROOT / "ops" / "prometheus"
CONFIG, RULES, RULE_TESTS = (PROMETHEUS_DIR / f for f in ("prometheus.yml", "specd-rules.yml", "specd-rules.test.yml"))
DASHBOARD = ROOT / "ops" / "grafana" / "specd-dashboard.json"
BUILDER = ROOT / "ops" / "grafana" / "build_dashboard.py"
NGRAM = {"speculation": {"method": "ngram", "num_speculative_tokens": 3}}
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
# prometheus_client's ProcessCollector (process_resident_memory_bytes, ...) reads /proc: Linux only
PROCESS_METRICS = sys.platform.startswith("linux")


def tool(name: str) -> str:
    """The path of a command-line tool; a missing one skips, except under CI."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (ops/test.sh installs it with apt)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


# -- PromQL metric names ----------------------------------------------------

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "inf", "nan"}
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{[^{}]*\}")
RANGES = re.compile(r"\[[^\]]*\]")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
IDENTIFIER = re.compile(r"(?<![\w$.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
LABEL_VALUES = re.compile(r"label_values\((.*),\s*\w+\)")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers left once strings, label
    matchers, ranges and grouping labels are removed, that are not functions,
    aggregations (followed by "(") or keywords."""
    for pattern in (STRINGS, MATCHERS, RANGES, GROUPING):
        expr = pattern.sub(" ", expr)
    return {m for m in IDENTIFIER.findall(expr) if m.lower() not in KEYWORDS}


def test_metric_names_parser():
    expr = ('sum by (instance, model_name) (rate(specd_a_total{reason=~"x|y", q="specd_fake"}[5m])) '
            '/ on (model_name) group_left instance_model:specd_b:rate5m{reason="z"} > 0.9 '
            "and on (x) max by (x) (specd_c offset 30m) == 0 or up{job=\"specd\"} "
            'or histogram_quantile(0.95, sum(rate(specd_d_bucket{model_name=~"$model_name"}[$__rate_interval])) by (le))')
    assert metric_names(expr) == {"specd_a_total", "instance_model:specd_b:rate5m", "specd_c", "up", "specd_d_bucket"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> dict[str, str]:
    """Every panel target's expression, keyed by "panel title / refId"."""
    return {f"{p['title']} / {t['refId']}": t["expr"]
            for p in dashboard()["panels"] for t in p.get("targets", [])}


# -- a daemon with traffic --------------------------------------------------

def ready(daemon, path: str) -> bool:
    status, body = daemon.get(f"/apis/specd.dev/v1alpha1/{path}")
    conditions = json.loads(body).get("status", {}).get("conditions", []) if status == 200 else []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def manifests(forged: Path) -> str:
    """``spec``: draft-paired, k=3.  ``capped``: one running and one waiting
    request at most (so bursts get 429), selected by a SpecPolicy that disables
    speculation (so requests asking for it count off steps)."""
    capped = model_manifest("capped", forged / "target", maxBatchSize=1, maxWaiting=1).replace(
        "  name: capped\n", "  name: capped\n  labels: {ops-test: capped}\n")
    return model_manifest("spec", forged / "target") + "---\n" + capped + textwrap.dedent(f"""\
        ---
        apiVersion: specd.dev/v1alpha1
        kind: DraftPairing
        metadata: {{name: spec-draft}}
        spec: {{targetRef: spec, method: draft, source: {forged / "draft"}, numSpeculativeTokens: 3}}
        ---
        apiVersion: specd.dev/v1alpha1
        kind: SpecPolicy
        metadata: {{name: no-speculation}}
        spec: {{selector: {{matchLabels: {{ops-test: capped}}}}, enabled: false}}
        """)


@pytest.fixture(scope="module")
def ops_daemon(forged, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("ops-daemon"), {"models.yaml": manifests(forged)})
    wait_for(lambda: ready(d, "draftpairings/spec-draft") and ready(d, "specpolicies/no-speculation"), 60,
             "the pairing and the policy to apply")
    yield d
    d.stop()


def drive(client: openai.OpenAI) -> None:
    """Plain, streaming and speculative requests (draft and n-gram), and an
    n-gram request to the policy-disabled model."""
    none = client.completions.create(model="spec", prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"speculation": {"method": "none"}})
    report = none.usage.speculation  # present whenever the request set speculation, "none" too
    assert (report["method"], report["source"], report["rounds"]) == ("none", "request", 0)
    stream = client.chat.completions.create(model="spec", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=24, stream=True, stream_options={"include_usage": True})
    assert any(chunk.usage for chunk in stream)
    paired = client.completions.create(model="spec", prompt=PROMPT, max_tokens=32, temperature=0)
    assert paired.usage.speculation["method"] == "draft"
    ngram = client.completions.create(model="spec", prompt=PROMPT, max_tokens=32, temperature=0.8, seed=1,
                                      extra_body=NGRAM)
    assert ngram.usage.speculation["method"] == "ngram"
    assert (paired.usage.speculation["source"], ngram.usage.speculation["source"]) == ("model", "request")
    # the policy keeps k at 0: the report still says what the request asked for, and that it decoded plainly
    off = client.completions.create(model="capped", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=NGRAM)
    report = off.usage.speculation
    assert (report["method"], report["source"], report["rounds"]) == ("ngram", "request", 0)
    assert report["plain_steps"] == off.usage.completion_tokens  # the first token too comes from a decode step


def overload(client: openai.OpenAI) -> None:
    """Bursts at ``capped`` until one request is turned away with 429."""
    def one(_):
        try:
            client.completions.create(model="capped", prompt=PROMPT, max_tokens=48, temperature=0)
        except openai.RateLimitError:
            return True
        return False
    with ThreadPoolExecutor(8) as pool:
        assert any(any(pool.map(one, range(8))) for _ in range(5)), "no request was rejected with 429"


def scrape(daemon) -> str:
    status, body = daemon.get("/metrics")
    assert status == 200
    return body.decode()


def samples(text: str) -> list:
    """Every sample in a /metrics body, parsed by prometheus_client's parser."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


@pytest.fixture(scope="module")
def ops_client(ops_daemon):
    return openai.OpenAI(base_url=ops_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def metrics_text(ops_daemon, ops_client) -> str:
    drive(ops_client)
    overload(ops_client)
    return scrape(ops_daemon)


# -- every metric used exists -------------------------------------------------

def test_rules_and_dashboard_use_only_exported_metrics(metrics_text):
    exported = {s.name for s in samples(metrics_text)}
    recorded = {r["record"] for r in rules() if "record" in r}
    uses = {f"rule {r.get('alert') or r['record']}": r["expr"] for r in rules()}
    uses.update({f"panel {k}": v for k, v in dashboard_queries().items()})
    uses.update({f"variable {v['name']}": LABEL_VALUES.fullmatch(v["definition"]).group(1)
                 for v in dashboard()["templating"]["list"] if v["type"] == "query"})
    used: dict[str, set[str]] = {}
    for where, expr in uses.items():
        for name in metric_names(expr):
            used.setdefault(name, set()).add(where)
    expected = {n for n in used if n != "up" and (PROCESS_METRICS or not n.startswith("process_"))}
    missing = {name: sorted(used[name]) for name in expected if name not in exported | recorded}
    assert not missing, f"not exported by the daemon: {json.dumps(missing, indent=1)}"
    # the parser found what it should (so the check above is not vacuous)
    assert recorded <= set(used), f"recording rules nothing uses: {recorded - set(used)}"
    assert {"up", "specd_model_ready", "specd_spec_decode_chosen_k_bucket", "specd_model_weight_bytes",
            "specd_mlx_active_memory_bytes", "process_resident_memory_bytes",
            "specd_spec_decode_num_accepted_tokens_per_pos_total"} <= set(used)
    assert len(used) >= 30


def test_memory_metrics(ops_daemon, metrics_text):
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples(metrics_text)}
    status, body = ops_daemon.get("/apis/specd.dev/v1alpha1/models/spec")
    assert status == 200
    weight_bytes = json.loads(body)["status"]["weightBytes"]
    assert weight_bytes > 0
    assert values[("specd_model_weight_bytes", (("model_name", "spec"),))] == weight_bytes
    active, peak = values[("specd_mlx_active_memory_bytes", ())], values[("specd_mlx_peak_memory_bytes", ())]
    assert 0 < active <= peak
    assert values[("specd_mlx_cache_memory_bytes", ())] >= 0
    if PROCESS_METRICS:
        assert values[("process_resident_memory_bytes", ())] > weight_bytes
    # what the daemon's imports made is out of every collection (a drain's included), so none examines it
    assert values[("specd_gc_frozen_objects", ())] > 10_000
    # failure counters start at 0, so the first failure shows in rate()
    assert values[("specd_request_failure_total", (("model_name", "spec"), ("reason", "engine_error")))] == 0


def test_deleted_model_leaves_no_readiness_or_weight_series(ops_daemon, forged):
    def specd(*args: str, stdin: str | None = None) -> None:
        subprocess.run([sys.executable, "-m", "specd.cli", *args, "--server", ops_daemon.url], input=stdin,
                       cwd=ROOT, check=True, capture_output=True, text=True, timeout=60)

    def series() -> set[str]:
        return {s.name for s in samples(scrape(ops_daemon)) if s.labels.get("model_name") == "doomed"}
    specd("apply", "-f", "-", stdin=model_manifest("doomed", forged / "target"))
    wait_for(lambda: {"specd_model_ready", "specd_model_weight_bytes"} <= series(), 60, "doomed to load")
    specd("delete", "model", "doomed")
    wait_for(lambda: not {"specd_model_ready", "specd_model_weight_bytes"} & series(), 30, "doomed's gauges to go")


# -- promtool -------------------------------------------------------------------

@pytest.mark.parametrize("args", [("check", "config", CONFIG), ("check", "rules", RULES),
                                  ("test", "rules", RULE_TESTS)], ids=lambda a: " ".join(map(str, a[:2])))
def test_promtool(args):
    proc = subprocess.run([tool("promtool"), *map(str, args)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the dashboard ------------------------------------------------------------

def test_dashboard_is_generated_and_well_formed():
    spec = importlib.util.spec_from_file_location("build_dashboard", BUILDER)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert builder.render() == DASHBOARD.read_text(), f"stale dashboard: run python {BUILDER.relative_to(ROOT)}"
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["model_name"]["definition"] == "label_values(specd_model_ready, model_name)"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], p["title"]
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("tokens", "time to first token", "inter-token", "end-to-end", "running and waiting",
                  "acceptance rate", "mean accepted length", "position", "k chosen", "by reason", "ready",
                  "memory", "weights"):
        assert topic in titles, topic


# -- a real Prometheus ------------------------------------------------------------

def prometheus_config(tmp: Path, target: str) -> Path:
    """The shipped config, scraping ``target`` every second, with the shipped rules."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [{"targets": [target]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def api(base: str, path: str, **params) -> dict:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, expr: str) -> list:
    return api(base, "query", query=expr)["result"]


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Grafana would send it with every model and instance selected."""
    for var, value in {"$model_name": ".*", "$instance": ".*", "$__rate_interval": "1m", "$__range": "5m"}.items():
        expr = expr.replace(var, value)
    return expr


def test_prometheus_scrapes_the_daemon(ops_daemon, ops_client, metrics_text, tmp_path):
    binary = tool("prometheus")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = prometheus_config(tmp_path, f"127.0.0.1:{ops_daemon.port}")
    log = tmp_path / "prometheus.log"
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        def scraped():
            assert proc.poll() is None, log.read_text()
            try:
                return query(base, "specd_request_success_total")
            except OSError:
                return None
        result = wait_for(scraped, 60, "Prometheus to scrape the daemon")
        assert {r["metric"]["model_name"] for r in result} >= {"spec", "capped"}
        (target,) = api(base, "targets")["activeTargets"]
        assert target["health"] == "up" and target["labels"]["job"] == "specd", target

        drive(ops_client)  # traffic between scrapes, so rates are non-zero
        queries = {name: grafana_to_promql(e) for name, e in dashboard_queries().items()
                   if PROCESS_METRICS or "process_" not in e}
        recorded = [r["record"] for r in rules() if "record" in r]
        queries.update({f"recorded {name}": name for name in recorded})
        wait_for(lambda: all(query(base, e) for e in queries.values()), 60, "every query to return data")
        assert set(api(base, "label/model_name/values", **{"match[]": "specd_model_ready"})) == {"spec", "capped"}

        def evaluated():
            groups = api(base, "rules")["groups"]
            loaded = [r for g in groups for r in g["rules"]]
            done = all(r["health"] == "ok" and not r["lastEvaluation"].startswith("0001-") for r in loaded)
            return len(loaded) == len(rules()) and done and loaded
        loaded = wait_for(evaluated, 30, "every rule to be evaluated without error")
        alerts = {r["name"] for r in loaded if r["type"] == "alerting"}
        assert alerts == {r["alert"] for r in rules() if "alert" in r} and "SpecdDown" in alerts
        assert not query(base, 'ALERTS{alertname="SpecdDown"}')
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
