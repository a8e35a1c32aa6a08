"""The console's live figures: per Model series over the last minutes, read from the same
counters ``/metrics`` exports (this daemon's, and on a head every Ready worker's), so the
console and a Prometheus scrape never disagree.

Sampling starts when the console first asks for figures and stops once nobody has asked for
``IDLE_SECONDS``: a daemon nobody looks at does no extra work. What was sampled is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

INTERVAL_SECONDS = 2.0
WINDOW_SECONDS = 600.0  # what the charts show
IDLE_SECONDS = 600.0

# the sample names summed per Model (over Nodes, and over labels such as the drafting method)
COUNTERS = {
    "tokens": "specd_generation_tokens_total",
    "ttft_sum": "specd_time_to_first_token_seconds_sum",
    "ttft_count": "specd_time_to_first_token_seconds_count",
    "drafts": "specd_spec_decode_num_drafts_total",
    "drafted": "specd_spec_decode_num_draft_tokens_total",
    "accepted": "specd_spec_decode_num_accepted_tokens_total",
    "queries": "specd_prefix_cache_queries_total",
    "hits": "specd_prefix_cache_hits_total",
}
GAUGES = {"running": "specd_num_requests_running", "waiting": "specd_num_requests_waiting"}
NAMES = {v: k for k, v in {**COUNTERS, **GAUGES}.items()}
SERIES = ("tokens_per_second", "ttft_seconds", "running", "waiting", "acceptance_rate", "mean_accepted_length",
          "prefix_hit_rate")

Totals = dict[str, dict[str, float]]  # model -> figure -> value at one instant


def totals(samples: Iterable[Sample]) -> Totals:
    """Each Model's counters and gauges, summed over whatever other labels they carry."""
    out: Totals = {}
    for s in samples:
        key, model = NAMES.get(s.name), s.labels.get("model_name")
        if key is not None and model is not None:
            figures = out.setdefault(model, {})
            figures[key] = figures.get(key, 0.0) + s.value
    return out


def scraped(text: str) -> list[Sample]:
    """The samples of a ``/metrics`` page, read by prometheus_client's own parser."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def between(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float | None]:
    """A Model's figures over one interval: rates from counters' increases (a counter that went
    down, an engine reloaded, counts from zero), gauges as read at its end. None: nothing
    happened that the figure could describe (no first token, no draft, no lookup)."""
    def grew(key: str) -> float:
        now, then = after.get(key, 0.0), before.get(key, 0.0)
        return now - then if now >= then else now
    return {"tokens_per_second": grew("tokens") / seconds if seconds > 0 else None,
            "ttft_seconds": _ratio(grew("ttft_sum"), grew("ttft_count")),
            "running": after.get("running", 0.0), "waiting": after.get("waiting", 0.0),
            "acceptance_rate": _ratio(grew("accepted"), grew("drafted")),
            "mean_accepted_length": _ratio(grew("accepted"), grew("drafts")),
            "prefix_hit_rate": _ratio(grew("hits"), grew("queries"))}


@dataclass
class FigureHistory:
    """Timed totals, sampled while the console asks, and the series drawn from them."""

    read: Callable[[], Awaitable[Totals]]  # every Node's totals now
    interval: float = INTERVAL_SECONDS
    samples: deque[tuple[float, Totals]] = field(default_factory=deque)
    asked: float = 0.0  # when the console last asked (monotonic)
    task: asyncio.Task | None = None

    async def sample(self) -> None:
        now = time.time()
        self.samples.append((now, await self.read()))
        while self.samples and self.samples[0][0] < now - WINDOW_SECONDS - self.interval:
            self.samples.popleft()

    async def _run(self) -> None:
        while time.monotonic() - self.asked < IDLE_SECONDS:
            await asyncio.sleep(self.interval)
            await self.sample()

    async def series(self) -> dict[str, object]:
        """Per Model, each figure as ``[[unix seconds, value or None], ...]`` over the window;
        starts sampling if nothing samples now."""
        self.asked = time.monotonic()
        if self.task is None or self.task.done():
            if not self.samples:
                await self.sample()
            self.task = asyncio.create_task(self._run())
        out: dict[str, dict[str, list]] = {}
        points = list(self.samples)
        for (t0, before), (t1, after) in zip(points, points[1:]):
            for model, figures in after.items():
                row = between(before.get(model, {}), figures, t1 - t0)
                lines = out.setdefault(model, {name: [] for name in SERIES})
                for name in SERIES:
                    lines[name].append([round(t1, 3), row[name]])
        return {"interval": self.interval, "window": WINDOW_SECONDS, "models": out}

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
