"""Prometheus metrics with vLLM's names under the `nanoserve:` prefix.

Gauges and the prefix-cache counters come from the engine core's latest SchedulerStats (sent
with every step and after idle-time changes); token counters and latency histograms are
measured here, in the API server, as outputs arrive (generated tokens step by step, as vLLM
counts them, not when a request ends). The engine's own figures carry an `engine` label, one
sample per engine core ("0", "1", ... with --data-parallel-size; "0" alone otherwise), as
vLLM labels them; a sum over the label is the server's figure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from nanoserve.output.processor import RequestState
from nanoserve.protocol import SchedulerStats

PREFIX = "nanoserve:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


# (metric name, help, SchedulerStats field) of each engine core's gauges and counters
_ENGINE_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_running"),
    ("num_requests_waiting", "Requests waiting to run.", "num_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_cache_usage"),
    ("kv_cache_blocks_in_use", "KV-cache blocks held by requests.", "kv_blocks_in_use"))
_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Requests preempted (KV cache full).", "num_preemptions"),
    ("kv_disk_cache_hits", "KV blocks read back from the prefix cache's disk tier.",
     "kv_disk_hits"),
    ("kv_disk_cache_misses", "Prompt blocks past the RAM cache not found on the disk tier.",
     "kv_disk_misses"),
    ("kv_disk_cache_read_bytes", "Bytes read from the disk tier.", "kv_disk_bytes_read"),
    ("kv_disk_cache_written_bytes", "Bytes written to the disk tier.",
     "kv_disk_bytes_written"),
    ("spec_decode_num_drafts", "Speculative steps: requests that drafted.",
     "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted (equal to the model's own "
     "draws).", "spec_decode_num_accepted_tokens"))


class _EngineCollector(Collector):
    """Reads each engine core's latest stats at scrape time: one sample per engine."""

    def __init__(self, stats: Callable[[], list[SchedulerStats]], model: str) -> None:
        self.stats = stats
        self.model = model

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = list(enumerate(self.stats()))
        label = ["model_name", "engine"]
        for name, doc, field in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=label)
            for engine, s in stats:
                gauge.add_metric([self.model, str(engine)], getattr(s, field))
            yield gauge
        for name, doc, field in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=label)
            for engine, s in stats:
                counter.add_metric([self.model, str(engine)], getattr(s, field))
            yield counter
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.", labels=[*label, "position"])
        for engine, s in stats:
            for position, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_position.add_metric([self.model, str(engine), str(position)], value)
        yield per_position


class Metrics:
    """The server's registry; also the OutputProcessor's timing observer."""

    def __init__(self, model: str, stats: Callable[[], list[SchedulerStats]]) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_EngineCollector(stats, model))
        label = ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.",
                                     label, registry=self.registry).labels(model)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Tokens generated.", label,
                                         registry=self.registry).labels(model)
        self.request_success = Counter(PREFIX + "request_success", "Requests finished.",
                                       ["model_name", "finished_reason"],
                                       registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time to first token.", label, buckets=_LATENCY_BUCKETS,
                              registry=self.registry).labels(model)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between output tokens.", label, buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Request latency, arrival to finish.", label,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model)
        # a request's `priority` (--scheduling-policy priority): how long each level waited
        # for its first token; values past +-16 share a series, so a client cannot grow the
        # registry without bound
        self.ttft_by_priority = Histogram(
            PREFIX + "time_to_first_token_seconds_by_priority",
            "Time to first token, by request priority.", ["model_name", "priority"],
            buckets=_LATENCY_BUCKETS, registry=self.registry)

    # -- TimingObserver ----------------------------------------------------------------------
    def first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)  # once per request, as its prefill is done

    def inter_token(self, seconds: float, num_tokens: int) -> None:
        for _ in range(max(num_tokens, 1)):
            self.itl.observe(seconds / max(num_tokens, 1))

    def generated(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def finished(self, state: RequestState) -> None:
        metrics = state.metrics
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_token_time is not None:
            self.ttft_by_priority.labels(self.model, _priority_label(state.params.priority)
                                         ).observe(metrics.first_token_time
                                                   - metrics.arrival_time)
        for sample in state.samples:
            self.request_success.labels(self.model,
                                        sample.completion.finish_reason or "abort").inc()

    def pooled(self, seconds: float, num_prompt_tokens: int) -> None:
        """An embedding or score request: its prompt tokens, its latency, a success (vLLM
        counts pooling requests in the same families)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.e2e.observe(seconds)
        self.request_success.labels(self.model, "stop").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _priority_label(priority: int) -> str:
    return str(priority) if -16 <= priority <= 16 else ("<-16" if priority < 0 else ">16")
