"""Build the specd Grafana dashboard: ``python ops/grafana/build_dashboard.py``.

Writes ``specd-dashboard.json`` next to this file (``--check`` only compares).
The panels come from a few helpers, so every latency panel, rate and filter is
written one way; edit this file, not the JSON, and re-run it.

Every query uses raw ``specd_`` metrics (no recording rules), so the dashboard
works against any Prometheus that scrapes specd; ``$model_name`` and
``$instance`` filter every panel.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("specd-dashboard.json")
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SELECT = 'model_name=~"$model_name", instance=~"$instance"'
INSTANCE = 'instance=~"$instance"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)


# -- PromQL ---------------------------------------------------------------

def rate(metric: str, by: str = "model_name", select: str = SELECT, window: str = RATE,
         fn: str = "rate") -> str:
    return f"sum by ({by}) ({fn}({metric}{{{select}}}[{window}]))"


def ratio(numerator: str, denominator: str, by: str, window: str = RATE, fn: str = "rate",
          on: str | None = None) -> str:
    """Per-``by`` ratio of two counters' rates (``on``: the denominator's coarser grouping)."""
    den_by = on or by
    join = f" / on ({on}) group_left " if on else " / "
    return rate(numerator, by, window=window, fn=fn) + join + rate(denominator, den_by, window=window, fn=fn)


# -- panels ---------------------------------------------------------------

def target(expr: str, legend: str, **extra) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True, **extra}


def quantiles(metric: str, label: str = "", qs=QUANTILES) -> list[dict]:
    """p50/p95/p99 of a histogram, per model."""
    by = "model_name, le"
    return [target(f"histogram_quantile({q}, {rate(metric + '_bucket', by)})",
                   f"{{{{model_name}}}} {label}p{round(q * 100)}") for q in qs]


def panel(kind: str, title: str, targets: list[dict], unit: str = "short", description: str = "",
          defaults: dict | None = None, **options) -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
            "fieldConfig": {"defaults": {"unit": unit, **(defaults or {})}, "overrides": []},
            "options": options}


def timeseries(title: str, targets: list[dict], unit: str = "short", description: str = "",
               stack: bool = False) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if stack else 0, "showPoints": "never",
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    return panel("timeseries", title, targets, unit, description, {"custom": custom},
                 legend={"displayMode": "list", "placement": "bottom", "showLegend": True},
                 tooltip={"mode": "multi", "sort": "desc"})


def instant(kind: str, title: str, targets: list[dict], unit: str = "short", description: str = "",
            defaults: dict | None = None, **options) -> dict:
    """A stat or bar gauge: one value per series, now (or over the dashboard's range)."""
    targets = [dict(t, instant=True, range=False) for t in targets]
    reduce = {"values": False, "calcs": ["lastNotNull"], "fields": ""}
    return panel(kind, title, targets, unit, description, defaults, reduceOptions=reduce, **options)


def thresholds(*steps: tuple[float | None, str]) -> dict:
    return {"mode": "absolute", "steps": [{"value": v, "color": c} for v, c in steps]}


class Grid:
    """Places panels left to right in Grafana's 24-column grid, rows under titled row panels."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}})
        self.y += 1

    def add(self, p: dict, w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        self.panels.append(dict(p, gridPos={"x": self.x, "y": self.y, "w": w, "h": h}))
        self.x += w
        self.row_height = max(self.row_height, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
        self.x = self.row_height = 0


# -- the dashboard ----------------------------------------------------------

def panels() -> list[dict]:
    g = Grid()
    g.row("Overview")
    g.add(instant("stat", "Model ready", [target(f"specd_model_ready{{{SELECT}}}", "{{model_name}} {{instance}}")],
                  description="1 when the model is loaded and serving (specd_model_ready).",
                  defaults={"mappings": [{"type": "value", "options": {
                      "0": {"text": "not ready", "color": "red", "index": 0},
                      "1": {"text": "ready", "color": "green", "index": 1}}}],
                      "thresholds": thresholds((None, "red"), (1, "green"))},
                  colorMode="background", graphMode="none", textMode="value_and_name"), w=6)
    g.add(instant("stat", "SpecPolicy k cap (0 = disabled)",
                  [target(f"specd_spec_policy_max_speculative_tokens{{{SELECT}}} * specd_spec_policy_enabled{{{SELECT}}}",
                          "{{model_name}} ({{policy}})")],
                  description="The k cap of the SpecPolicy each model runs, 0 when the policy disables speculation. "
                              "Models without a SpecPolicy do not appear.",
                  colorMode="none", graphMode="none", textMode="value_and_name"), w=6)
    g.add(timeseries("Requests / s", [
        target(rate("specd_request_success_total", "model_name, finished_reason"), "{{model_name}} {{finished_reason}}"),
        target(rate("specd_request_failure_total", "model_name, reason"), "{{model_name}} failed: {{reason}}"),
    ], "reqps", "Finished requests by finish reason (stop, length, abort) and failures (overloaded = 429, engine_error)."),
        w=12)
    g.add(timeseries("Tokens / s", [
        target(rate("specd_generation_tokens_total"), "{{model_name}} generated"),
        target(rate("specd_prompt_tokens_total"), "{{model_name}} prompt (prefill)"),
    ], "short", "Generated and prefilled prompt tokens per second."))
    g.add(timeseries("Running and waiting requests", [
        target(f"sum by (model_name) (specd_num_requests_running{{{SELECT}}})", "{{model_name}} running"),
        target(f"sum by (model_name) (specd_num_requests_waiting{{{SELECT}}})", "{{model_name}} waiting"),
    ], "short", "Requests in the running batch (at most maxBatchSize) and in the queue (at most maxWaiting, then 429)."))
    g.add(timeseries("Time in queue", quantiles("specd_request_queue_time_seconds"), "s",
                     "Time from arrival to the start of prefill."))

    g.row("Latency")
    g.add(timeseries("Time to first token", quantiles("specd_time_to_first_token_seconds"), "s"))
    g.add(timeseries("Inter-token latency", quantiles("specd_inter_token_latency_seconds"), "s",
                     "Time between output tokens (a speculative round that yields n tokens counts 1/n per token)."))
    g.add(timeseries("End-to-end request latency", quantiles("specd_e2e_request_latency_seconds"), "s"))

    g.row("Speculative decoding")
    by = "model_name, method"
    g.add(timeseries("Acceptance rate", [
        target(ratio("specd_spec_decode_num_accepted_tokens_total", "specd_spec_decode_num_draft_tokens_total", by),
               "{{model_name}} {{method}}"),
        target(f"specd_spec_decode_acceptance_ema{{{SELECT}}}", "{{model_name}} controller EMA"),
    ], "percentunit", "Accepted / proposed tokens, by proposer, and the speculation controller's moving average."))
    g.add(timeseries("Mean accepted length", [
        target("1 + " + ratio("specd_spec_decode_num_accepted_tokens_total", "specd_spec_decode_num_drafts_total", by),
               "{{model_name}} {{method}}"),
    ], "short", "Tokens per speculative round: accepted proposals plus the target's own token (1 = nothing accepted)."))
    g.add(instant("bargauge", "Acceptance by draft position", [
        target(ratio("specd_spec_decode_num_accepted_tokens_per_pos_total", "specd_spec_decode_num_drafts_total",
                     f"{by}, position", window="$__range", fn="increase", on=by),
               "{{model_name}} {{method}} #{{position}}"),
    ], "percentunit", "Share of speculative rounds whose proposal at each position (0 = first) was accepted, "
                      "over the dashboard's time range.", defaults={"min": 0, "max": 1},
        orientation="horizontal", displayMode="gradient", showUnfilled=True))
    g.add(panel("heatmap", "Proposals per request (k chosen)", [
        target(rate("specd_spec_decode_chosen_k_bucket", "le", fn="increase"), "{{le}}", format="heatmap"),
    ], "short", "How many tokens the controller let each speculating request propose, per step (0 = held back).",
        calculate=False, cellGap=1, yAxis={"axisPlacement": "left", "unit": "short"},
        rowsFrame={"layout": "le"}, color={"mode": "scheme", "scheme": "Oranges", "fill": "dark",
                                           "scale": "exponential", "exponent": 0.5, "steps": 64},
        tooltip={"mode": "single", "yHistogram": False}, legend={"show": True}))
    g.add(timeseries("Kept from speculating, by reason", [
        target(rate("specd_spec_decode_off_steps_total", "model_name, reason"), "{{model_name}} {{reason}}"),
    ], "short", "Request-steps per second the controller kept from speculating: policy_disabled, batch_size "
                "(disableByBatchSize), low_acceptance (EMA under acceptanceRateThreshold), no_gain (goodput).",
        stack=True))
    g.add(timeseries("Speculation time per step (p95)", [
        *quantiles("specd_spec_decode_propose_seconds", "propose ", (0.95,)),
        *quantiles("specd_spec_decode_verify_seconds", "verify ", (0.95,)),
        *quantiles("specd_spec_decode_rollback_seconds", "rollback ", (0.95,)),
    ], "s", "Proposing (n-gram lookup or draft model), acceptance sampling after the verify forward, KV rollback."))

    g.row("Memory")
    g.add(instant("bargauge", "Model weights", [
        target(f"sum by (model_name) (specd_model_weight_bytes{{{SELECT}}})", "{{model_name}}"),
    ], "bytes", "Bytes of each serving target model's weights.", orientation="horizontal", displayMode="basic",
        showUnfilled=True), w=8)
    g.add(timeseries("Process memory", [
        target(f"process_resident_memory_bytes{{{INSTANCE}}}", "{{instance}} resident (RSS)"),
        *(target(f"specd_mlx_{kind}_memory_bytes{{{INSTANCE}}}", f"{{{{instance}}}} MLX {kind}")
          for kind in ("active", "cache", "peak")),
    ], "bytes", "Resident set size of the daemon; MLX memory held by arrays (active), kept for reuse (cache) "
                "and the active peak since start. On Apple Silicon MLX memory is unified GPU memory."), w=16)
    for i, p in enumerate(g.panels, start=1):
        p["id"] = i
    return g.panels


def variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": f"{name}-variable"},
            "multi": True, "includeAll": True, "allValue": ".*", "current": {},
            "refresh": 2, "sort": 1, "regex": "", "hide": 0, "options": []}


def dashboard() -> dict:
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": kind, "name": kind} for kind in ("bargauge", "heatmap", "stat", "timeseries")),
        ],
        "uid": "specd-overview",
        "title": "specd",
        "description": "specd daemons: traffic, latency, speculative decoding and memory.",
        "tags": ["specd", "llm", "mlx"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
            variable("model_name", "Model", "label_values(specd_model_ready, model_name)"),
            variable("instance", "Instance", 'label_values(specd_model_ready{model_name=~"$model_name"}, instance)'),
        ]},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    text = render()
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else f"{OUT} is stale: re-run {__file__}")
    OUT.write_text(text)
    print(f"wrote {OUT}")
