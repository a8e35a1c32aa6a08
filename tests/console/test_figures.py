"""The console's live figures, read from ``/metrics`` text by prometheus_client's parser: rates
over an interval, a restarted engine's counters, and figures nothing happened to describe."""

from __future__ import annotations

import asyncio

from specd.console.figures import FigureHistory, between, scraped, totals
from specd.metrics import Metrics
from prometheus_client import generate_latest


def exported(metrics: Metrics) -> dict:
    return totals(scraped(generate_latest(metrics.registry).decode()))


def test_figures_are_rates_over_the_interval_summed_over_methods_and_nodes():
    metrics = Metrics()
    before = exported(metrics)
    metrics.generation_tokens.labels("m").inc(50)
    metrics.time_to_first_token.labels("m").observe(0.2)
    metrics.time_to_first_token.labels("m").observe(0.4)
    for method, drafts, drafted, accepted in (("ngram", 2, 6, 3), ("draft", 2, 8, 5)):
        metrics.spec_num_drafts.labels("m", method).inc(drafts)
        metrics.spec_num_draft_tokens.labels("m", method).inc(drafted)
        metrics.spec_num_accepted_tokens.labels("m", method).inc(accepted)
    metrics.prefix_cache_queries.labels("m").inc(100)
    metrics.prefix_cache_hits.labels("m").inc(75)
    metrics.requests_running.labels("m").set(3)
    other_node = Metrics()  # a worker serving another replica of m
    other_node.generation_tokens.labels("m").inc(30)
    after = totals(scraped(generate_latest(metrics.registry).decode() + generate_latest(other_node.registry).decode()))
    row = between(before.get("m", {}), after["m"], 2.0)
    assert row["tokens_per_second"] == 40.0
    assert abs(row["ttft_seconds"] - 0.3) < 1e-9
    assert row["acceptance_rate"] == 8 / 14 and row["mean_accepted_length"] == 8 / 4
    assert row["prefix_hit_rate"] == 0.75 and row["running"] == 3.0 and row["waiting"] == 0.0


def test_a_restarted_engine_counts_from_zero_and_an_idle_interval_describes_nothing():
    row = between({"tokens": 500.0, "drafts": 10.0}, {"tokens": 20.0, "drafts": 10.0}, 1.0)
    assert row["tokens_per_second"] == 20.0  # the counter went down: its engine reloaded
    assert row["ttft_seconds"] is None and row["acceptance_rate"] is None and row["prefix_hit_rate"] is None


def test_history_draws_each_models_series_from_its_samples_and_stops_when_closed():
    counts = iter(range(1000))

    async def read():
        return {"m": {"tokens": 10.0 * next(counts)}}

    async def run():
        history = FigureHistory(read)
        first = await history.series()  # the first sample: nothing to draw between yet
        for _ in range(2):
            await history.sample()
        later = await history.series()
        sampler = history.task
        await history.close()
        return first, later, sampler
    first, later, sampler = asyncio.run(run())
    assert first["models"] == {}
    assert [v is not None and v > 0 for _, v in later["models"]["m"]["tokens_per_second"]] == [True, True]
    assert sampler.done()
