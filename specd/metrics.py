"""Prometheus metrics, named after vLLM's with a ``specd_`` prefix.

Dashboards written for vLLM translate 1:1 by swapping ``vllm:`` for
``specd_``; every series carries the served model name as ``model_name``.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from contextlib import suppress

import mlx.core as mx
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
FAILURE_REASONS = ("overloaded", "engine_error", "out_of_memory")  # specd_request_failure_total{reason}
# Process-wide MLX allocator readings, taken at scrape time: name -> (reader, help).
MLX_MEMORY = {
    "specd_mlx_active_memory_bytes": (mx.get_active_memory, "Memory held by live MLX arrays (all models)."),
    "specd_mlx_peak_memory_bytes": (mx.get_peak_memory, "Highest MLX active memory since the daemon started."),
    "specd_mlx_cache_memory_bytes": (mx.get_cache_memory, "Memory MLX keeps cached for reuse, not held by arrays."),
    "specd_mlx_memory_limit_bytes": (mx.get_memory_limit, "MLX's memory limit: requests start only with room under it."),
}


class Metrics:
    """All of a daemon's metric families, registered in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.node = "localhost"  # named by node_info
        self._disk_lock = threading.Lock()
        self._disk_seen: dict[str, dict[str, int]] = {}  # per model, the disk tier's counters as last mirrored
        self.requests_running = Gauge(
            "specd_num_requests_running", "Requests in the running batch.", m, registry=r)
        self.requests_waiting = Gauge(
            "specd_num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r)
        self.request_success = Counter(
            "specd_request_success", "Finished requests, by finish reason.",
            m + ["finished_reason"], registry=r)
        self.request_failure = Counter(
            "specd_request_failure", "Requests that ended with an engine error or were rejected.",
            m + ["reason"], registry=r)
        self.engine_faults = Counter(
            "specd_engine_faults", "Engine steps that raised: their requests got errors.", m, registry=r)
        self.prompt_tokens = Counter(
            "specd_prompt_tokens", "Prompt tokens of admitted requests (cached ones included).", m, registry=r)
        self.prompt_images = Counter(
            "specd_prompt_images", "Images in the prompts of admitted requests.", m, registry=r)
        self.prefix_cache_queries = Counter(
            "specd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r)
        self.prefix_cache_hits = Counter(
            "specd_prefix_cache_hits", "Prompt tokens restored from the prefix cache.", m, registry=r)
        self.prefix_cache_bytes = Gauge(
            "specd_prefix_cache_bytes", "Bytes the prefix cache holds (target, draft model, EAGLE head).",
            m, registry=r)
        self.prefix_cache_max_bytes = Gauge(
            "specd_prefix_cache_max_bytes", "The prefix cache's budget (prefixCache.maxBytes).", m, registry=r)
        self.prefix_disk_hit_tokens = Counter(
            "specd_prefix_disk_hit_tokens", "Prompt tokens read from the prefix cache's disk tier into RAM.",
            m, registry=r)
        self.prefix_disk_read_bytes = Counter(
            "specd_prefix_disk_read_bytes", "Bytes of blocks read from the prefix cache's disk tier.", m, registry=r)
        self.prefix_disk_written_bytes = Counter(
            "specd_prefix_disk_written_bytes", "Bytes of blocks written to the prefix cache's disk tier.",
            m, registry=r)
        self.prefix_disk_evicted_blocks = Counter(
            "specd_prefix_disk_evicted_blocks", "Blocks deleted from the disk tier to stay within its maxBytes.",
            m, registry=r)
        self.prefix_disk_dropped_blocks = Counter(
            "specd_prefix_disk_dropped_blocks",
            "Blocks not written: the writer's queue was full or the disk refused writes.", m, registry=r)
        self.prefix_disk_refused_blocks = Counter(
            "specd_prefix_disk_refused_blocks",
            "Block files refused and deleted, by kind (corrupt, truncated, foreign, mismatched).",
            m + ["kind"], registry=r)
        self.prefix_disk_restore_seconds = Histogram(
            "specd_prefix_disk_restore_seconds",
            "From a request's disk read starting to its blocks being in the RAM tree.", m,
            buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_disk_bytes = Gauge(
            "specd_prefix_disk_bytes", "Bytes the disk tier's directory holds.", m, registry=r)
        self.prefix_disk_max_bytes = Gauge(
            "specd_prefix_disk_max_bytes", "The disk tier's budget (prefixCache.disk.maxBytes).", m, registry=r)
        self.prefix_disk_available = Gauge(
            "specd_prefix_disk_available",
            "1 while the disk tier writes blocks, 0 while the disk refuses them (full, read-only).", m, registry=r)
        self.kv_cache_bytes = Gauge(
            "specd_kv_cache_bytes", "Bytes the running rows' KV caches hold (target and drafter).", m, registry=r)
        self.kv_cache_max_bytes = Gauge(
            "specd_kv_cache_max_bytes", "The KV budget (kvCache.maxBytes).", m, registry=r)
        self.kv_cache_shared_tokens = Gauge(
            "specd_kv_cache_shared_tokens",
            "Tokens the running rows read in place from the prefix cache (each would otherwise hold its own copy).",
            m, registry=r)
        self.kv_preemptions = Counter(
            "specd_kv_preemptions", "Running requests preempted to fit the KV budget (recomputed later).",
            m, registry=r)
        self.memory_preemptions = Counter(
            "specd_memory_preemptions", "Running requests preempted while MLX was past its memory limit "
            "(recomputed later).", m, registry=r)
        self.grammar_forced_tokens = Counter(
            "specd_grammar_forced_tokens", "Tokens a grammar forced, verified in the forward that proposed them.",
            m, registry=r)
        self.generation_tokens = Counter(
            "specd_generation_tokens", "Generated tokens.", m, registry=r)
        self.time_to_first_token = Histogram(
            "specd_time_to_first_token_seconds", "Time to first token.", m,
            buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "specd_inter_token_latency_seconds", "Time between output tokens.", m,
            buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "specd_e2e_request_latency_seconds", "End-to-end request latency.", m,
            buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "specd_request_queue_time_seconds", "Time a request waited before prefill.", m,
            buckets=LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(
            "specd_request_prompt_tokens", "Prompt length per request.", m,
            buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "specd_request_generation_tokens", "Generated tokens per request.", m,
            buckets=TOKEN_BUCKETS, registry=r)
        spec = m + ["method"]
        self.spec_num_drafts = Counter(
            "specd_spec_decode_num_drafts", "Speculation rounds with at least one proposal.", spec, registry=r)
        self.spec_num_draft_tokens = Counter(
            "specd_spec_decode_num_draft_tokens", "Proposed tokens.", spec, registry=r)
        self.spec_num_accepted_tokens = Counter(
            "specd_spec_decode_num_accepted_tokens", "Accepted proposed tokens.", spec, registry=r)
        self.spec_accepted_per_pos = Counter(
            "specd_spec_decode_num_accepted_tokens_per_pos", "Accepted proposals by position in the draft.",
            spec + ["position"], registry=r)
        self.spec_propose_seconds = Histogram(
            "specd_spec_decode_propose_seconds", "Time proposing per step.", spec,
            buckets=LATENCY_BUCKETS, registry=r)
        self.spec_verify_seconds = Histogram(
            "specd_spec_decode_verify_seconds", "Time in acceptance sampling per step (after the forward).",
            m, buckets=LATENCY_BUCKETS, registry=r)
        self.spec_rollback_seconds = Histogram(
            "specd_spec_decode_rollback_seconds", "Time rolling KV caches back per step.", m,
            buckets=LATENCY_BUCKETS, registry=r)
        self.spec_off_steps = Counter(
            "specd_spec_decode_off_steps", "Request-steps the controller kept from speculating, by reason.",
            m + ["reason"], registry=r)
        self.spec_acceptance_ema = Gauge(
            "specd_spec_decode_acceptance_ema", "The controller's moving average of the acceptance rate.",
            m, registry=r)
        self.spec_policy_enabled = Gauge(
            "specd_spec_policy_enabled", "1 when the model's SpecPolicy lets it speculate.",
            m + ["policy"], registry=r)
        self.spec_policy_max_tokens = Gauge(
            "specd_spec_policy_max_speculative_tokens", "The SpecPolicy's cap on k.", m + ["policy"], registry=r)
        self.spec_policy_generation = Gauge(
            "specd_spec_policy_observed_generation", "Generation of the SpecPolicy the model runs.",
            m + ["policy"], registry=r)
        self.spec_chosen_k = Histogram(
            "specd_spec_decode_chosen_k", "Proposals per request chosen by the controller, per step.",
            m, buckets=tuple(range(17)), registry=r)
        self.spec_step_seconds = Gauge(
            "specd_spec_decode_step_seconds", "Last verify-forward time: measured, and as the cost model predicted it.",
            m + ["kind"], registry=r)
        self.model_ready = Gauge(
            "specd_model_ready", "1 when the model is loaded and serving.", m, registry=r)
        self.model_weight_bytes = Gauge(
            "specd_model_weight_bytes", "Bytes of the serving target model's weights (a draft's not included).",
            m, registry=r)
        self.models_loaded = Gauge("specd_models_loaded", "Models with a loaded engine on this node.", registry=r)
        self.model_load_seconds = Histogram(
            "specd_model_load_seconds", "Seconds from placing a Model to serving it (weights, drafter, warm-up).",
            m, buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=r)
        self.model_unloads = Counter(
            "specd_model_unloads_total", "Engines unloaded, by reason: idle, evicted (to make room), replaced.",
            m + ["reason"], registry=r)
        self.model_memory_request = Gauge(
            "specd_model_memory_request_bytes", "What a loaded Model requests of the node's memory.", m, registry=r)
        self.model_download_bytes = Gauge(
            "specd_model_download_bytes", "A hub checkpoint's download (target and drafter): bytes done, total.",
            m + ["kind"], registry=r)
        self.routed_requests = Counter(
            "specd_routed_requests_total", "Requests a cluster head sent to each replica of a Model, by Node.",
            m + ["node"], registry=r)
        self.replica_requests_running = Gauge(
            "specd_replica_requests_running", "Requests a cluster head has sent to a Model's replica on a Node "
            "and not yet seen end.", m + ["node"], registry=r)
        self.replica_failed_requests = Counter(
            "specd_replica_failed_requests_total", "Requests a Model's replica on a Node ended with an error "
            "(its Node lost included), as the cluster head saw them.", m + ["node"], registry=r)
        self.replica_tokens = Counter(
            "specd_replica_tokens_total", "Tokens of the requests a cluster head routed, by the Model's replica "
            "that served them: prompt, cached (prompt tokens its prefix cache held) and generation.",
            m + ["node", "kind"], registry=r)
        self.node_memory_bytes = Gauge(
            "specd_node_memory_bytes", "The node's memory: capacity, allocatable, requested (by loaded and loading "
            "Models), in use (their weights, KV and prefix caches).", ["node", "kind"], registry=r)
        # HTTP traffic, named as vLLM's exporter (prometheus-fastapi-instrumentator) names it, with
        # exact status codes so a 404 and a 400 are told apart; handler is the route's template.
        self.http_requests = Counter(
            "http_requests", "HTTP requests by method, route and status code (499: the client went away).",
            ["method", "handler", "status"], registry=r)
        self.http_request_duration = Histogram(
            "http_request_duration_seconds", "Time to answer an HTTP request (a stream: until its last byte).",
            ["method", "handler"], buckets=LATENCY_BUCKETS, registry=r)
        for name, (read, doc) in MLX_MEMORY.items():
            Gauge(name, doc, registry=r).set_function(read)
        Gauge("specd_gc_frozen_objects", "Objects the daemon made while starting (its imports), left out of "
              "garbage collection: a collection examines only what was made since.",
              registry=r).set_function(gc.get_freeze_count)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...

    def model_loaded(self, name: str, weight_bytes: int) -> None:
        """A model started serving: record its weights, and start its failure
        and preemption counters at 0 so the first one shows in rate()/increase()
        (a series that appears already at 1 does not)."""
        self.model_weight_bytes.labels(name).set(weight_bytes)
        for reason in FAILURE_REASONS:
            self.request_failure.labels(name, reason)
        self.engine_faults.labels(name)
        self.kv_preemptions.labels(name)
        self.memory_preemptions.labels(name)

    def model_download(self, name: str, done: int, total: int) -> None:
        self.model_download_bytes.labels(name, "done").set(done)
        self.model_download_bytes.labels(name, "total").set(total)

    def node_info(self, node: str, capacity: int, allocatable: int) -> None:
        self.node = node
        self.node_memory_bytes.labels(node, "capacity").set(capacity)
        self.node_memory_bytes.labels(node, "allocatable").set(allocatable)

    def node_memory_from(self, requested: Callable[[], int], in_use: Callable[[], int],
                         loaded: Callable[[], int]) -> None:
        """The node's memory gauges, read when they are scraped (on the event loop, as the
        reconcilers' state is) rather than computed again at every reconcile."""
        self.node_memory_bytes.labels(self.node, "requested").set_function(requested)
        self.node_memory_bytes.labels(self.node, "in_use").set_function(in_use)
        self.models_loaded.set_function(loaded)

    def prefix_disk_status(self, name: str, status: dict, fresh: bool = False) -> None:
        """Mirror a disk tier's status (``DiskTier.status``: its counters only grow; called from
        its threads); ``fresh``: a new engine's tier, counting from 0."""
        with self._disk_lock:
            seen = self._disk_seen.setdefault(name, {})
            if fresh:
                seen.clear()
            for key, counter in (("hitTokens", self.prefix_disk_hit_tokens), ("readBytes", self.prefix_disk_read_bytes),
                                 ("writtenBytes", self.prefix_disk_written_bytes),
                                 ("evictedBlocks", self.prefix_disk_evicted_blocks),
                                 ("droppedBlocks", self.prefix_disk_dropped_blocks)):
                if status[key] > seen.get(key, 0):
                    counter.labels(name).inc(status[key] - seen.get(key, 0))
                seen[key] = status[key]
            for kind, count in status["refusedBlocks"].items():
                if count > seen.get(kind, 0):
                    self.prefix_disk_refused_blocks.labels(name, kind).inc(count - seen.get(kind, 0))
                seen[kind] = count
        self.prefix_disk_bytes.labels(name).set(status["bytes"])
        self.prefix_disk_available.labels(name).set(1 if status["available"] else 0)

    def forget_model(self, name: str) -> None:
        """A deleted model leaves no readiness or weight series behind (its
        counters and histograms stay, as Prometheus expects of counters)."""
        for gauge in (self.model_ready, self.model_weight_bytes, self.model_memory_request, self.prefix_cache_bytes,
                      self.prefix_cache_max_bytes, self.kv_cache_bytes, self.kv_cache_max_bytes,
                      self.kv_cache_shared_tokens, self.prefix_disk_bytes, self.prefix_disk_max_bytes,
                      self.prefix_disk_available):
            with suppress(KeyError):  # older prometheus_client versions raise for unknown labels
                gauge.remove(name)
        for kind in ("done", "total"):
            with suppress(KeyError):
                self.model_download_bytes.remove(name, kind)
