"""Prometheus metrics with SGLang's names (`sglang:` prefix, a `model_name` label).

Everything is measured where it happens, in the scheduler process (`SchedulerMetrics`: counters
and latency histograms as plain numbers, cheap enough for the decode loop), and travels to the
HTTP process with the scheduler's internal state when `/metrics` is scraped; `render` turns that
state into the Prometheus text format. One source, so nothing is double counted and the values
are exactly the scheduler's.
"""

from __future__ import annotations

import bisect
import time

from srt.managers.io_struct import FINISH_ABORT
from srt.managers.scheduler_state import SchedulerState

PREFIX = "sglang:"

# Upper bounds in seconds (SGLang's ranges, trimmed).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 120.0)
ITL_BUCKETS = (
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.0,
)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.8, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time to first token: arrival to the first output token", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between consecutive output tokens of a request", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("End-to-end request latency: arrival to finish", E2E_BUCKETS),
    "queue_time_seconds": ("Time from arrival to the first prefill", QUEUE_BUCKETS),
}
COUNTERS = {
    "prompt_tokens": "Prompt tokens of finished requests",
    "generation_tokens": "Output tokens of finished requests",
    "cached_tokens": "Prompt tokens served from the radix cache",
    "num_requests": "Finished requests (any finish reason)",
    "num_aborted_requests": "Requests that ended aborted (client gone, /abort_request, errors)",
}
GAUGES = {
    "num_running_reqs": "Requests in the running batch",
    "num_queue_reqs": "Requests waiting to be scheduled",
    "num_grammar_queue_reqs": "Requests waiting for their grammar to compile",
    "num_used_tokens": "KV slots held by requests (not counting the evictable cache)",
    "token_usage": "Fraction of the KV pool held by requests",
    "cache_hit_rate": "Fraction of prompt tokens served from the radix cache",
    "gen_throughput": "Output tokens per second over the last decode log interval",
    "num_retractions": "Requests retracted to the queue for lack of KV memory, since start",
    "spec_accept_length": "Speculative decoding: tokens per request per decode step, since start (1 without drafts)",
    "spec_accept_rate": "Speculative decoding: fraction of draft tokens accepted, since start",
}
# --enable-hierarchical-cache only: (doc, path in the scheduler state's "hicache" entry)
HICACHE_GAUGES = {
    "hicache_host_used_tokens": ("Tokens held in the host tier", ("host", "used_tokens")),
    "hicache_host_capacity_tokens": ("Capacity of the host tier in tokens", ("host", "capacity_tokens")),
    "hicache_storage_bytes": ("Bytes held by the storage tier's files", ("storage", "bytes")),
}
HICACHE_COUNTERS = {
    "hicache_device_hit_tokens": ("Prompt tokens served from the device tier", ("device", "hit_tokens")),
    "hicache_host_hit_tokens": ("Prompt tokens served from the host tier", ("host", "hit_tokens")),
    "hicache_storage_hit_tokens": ("Prompt tokens served from the storage tier", ("storage", "hit_tokens")),
    "hicache_backup_bytes": ("Bytes copied from the device tier to the host tier", ("host", "backup_bytes")),
    "hicache_load_back_bytes": ("Bytes copied from the host tier to the device tier", ("host", "load_back_bytes")),
    "hicache_load_back_seconds": ("Time spent copying host to device", ("host", "load_back_s")),
    "hicache_storage_read_bytes": ("Bytes read from the storage tier", ("storage", "bytes_read")),
    "hicache_storage_written_bytes": ("Bytes written to the storage tier", ("storage", "bytes_written")),
    "hicache_prefetch_seconds": ("Time the storage reader spent on prefetches", ("storage", "prefetch_s")),
}


# --enable-priority-scheduling / --tenant-fair-share only (the scheduler state's "qos" entry)
QOS_COUNTERS = {
    "num_preemptions": ("Running requests preempted for more urgent ones", "preemptions"),
    "num_queue_rejections": ("Requests refused for a full waiting queue (priority scheduling)", "queue_rejections"),
}
# --tenant-config / --tenant-* only: per tenant, from the HTTP process's admission
TENANT_COUNTERS = {
    "tenant_requests": ("Requests admitted, per tenant", "requests"),
    "tenant_prompt_tokens": ("Prompt tokens admitted, per tenant", "prompt_tokens"),
    "tenant_generation_tokens": ("Output tokens generated, per tenant", "completion_tokens"),
}

# --disaggregation-mode prefill / decode only (SGLang's names; the scheduler state's "disagg" entry)
DISAGG_GAUGES = {
    "num_prefill_prealloc_queue_reqs": "Prefill: requests waiting for their decode side to reserve KV",
    "num_prefill_inflight_queue_reqs": "Prefill: requests whose KV is being written to the decode side",
    "num_decode_prealloc_queue_reqs": "Decode: requests waiting for the prefill server's address or for KV room",
    "num_decode_transfer_queue_reqs": "Decode: requests waiting for their KV from the prefill side",
    "kv_transfer_speed_gb_s": "KV transfer speed of the latest request (GB/s)",
    "kv_transfer_latency_ms": "KV transfer time of the latest request (ms)",
}


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def state(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class SchedulerMetrics:
    def __init__(self) -> None:
        self.histograms = {name: Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.gen_throughput = 0.0
        self._ttft = self.histograms["time_to_first_token_seconds"]
        self._itl = self.histograms["inter_token_latency_seconds"]

    def on_admitted(self, req) -> None:
        self.histograms["queue_time_seconds"].observe(max(time.time() - req.created_time, 0.0))

    def on_token(self, req, now: float) -> None:
        """A new output token of req reached the host (now: time.time())."""
        last = req.last_token_time
        if last is None:
            self._ttft.observe(max(now - req.created_time, 0.0))
        else:
            self._itl.observe(now - last)
        req.last_token_time = now

    def on_finished(self, req) -> None:
        c = self.counters
        c["num_requests"] += 1
        c["prompt_tokens"] += len(req.origin_input_ids)
        c["generation_tokens"] += len(req.output_ids)
        c["cached_tokens"] += req.cached_tokens
        if isinstance(req.finished_reason, FINISH_ABORT):
            c["num_aborted_requests"] += 1
        self.histograms["e2e_request_latency_seconds"].observe(max(time.time() - req.created_time, 0.0))

    def state(self) -> dict:
        return {
            "counters": dict(self.counters),
            "gen_throughput": self.gen_throughput,
            "histograms": {name: h.state() for name, h in self.histograms.items()},
        }


class _StateCollector:
    """A prometheus_client collector over one scrape of the schedulers' states: one series per
    metric, or one per data-parallel replica (a `dp_rank` label) when there are several."""

    def __init__(self, model_name: str, scheduler_states: list[SchedulerState], tenants: dict | None = None):
        self.model_name = model_name
        self.states = scheduler_states
        self.tenants = tenants

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        per_replica = len(self.states) > 1
        names = ["model_name"] + (["dp_rank"] if per_replica else [])
        families = {}
        for name, doc in GAUGES.items():
            families[name] = GaugeMetricFamily(PREFIX + name, doc, labels=names)
        for name, doc in COUNTERS.items():
            families[name] = CounterMetricFamily(PREFIX + name, doc, labels=names)
        for name, (doc, _) in HISTOGRAMS.items():
            families[name] = HistogramMetricFamily(PREFIX + name, doc, labels=names)
        hicache = any(st.hicache for st in self.states)
        if hicache:
            for name, (doc, _) in HICACHE_GAUGES.items():
                families[name] = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            for name, (doc, _) in HICACHE_COUNTERS.items():
                families[name] = CounterMetricFamily(PREFIX + name, doc, labels=names)
        disagg = any(st.disagg for st in self.states)
        if disagg:
            for name, doc in DISAGG_GAUGES.items():
                families[name] = GaugeMetricFamily(PREFIX + name, doc, labels=names)
        qos = any(st.qos for st in self.states)
        if qos:
            for name, (doc, _) in QOS_COUNTERS.items():
                families[name] = CounterMetricFamily(PREFIX + name, doc, labels=names)
        for st in self.states:
            labels = [self.model_name] + ([str(st.dp_rank)] if per_replica else [])
            metrics = st.metrics
            assert metrics is not None, "/metrics is served only with --enable-metrics"
            spec = st.speculative
            gauges = {
                "num_running_reqs": st.num_running_reqs,
                "num_queue_reqs": st.num_queue_reqs,
                "num_grammar_queue_reqs": st.num_grammar_queue_reqs,
                "num_used_tokens": st.used_tokens,
                "token_usage": st.token_usage,
                "cache_hit_rate": st.cache_hit_rate,
                "gen_throughput": st.gen_throughput,
                "num_retractions": st.total_retractions,
                "spec_accept_length": spec.avg_accept_length if spec is not None else 0.0,
                "spec_accept_rate": spec.accept_rate if spec is not None else 0.0,
            }
            for name in GAUGES:
                families[name].add_metric(labels, gauges[name])
            for name in COUNTERS:
                families[name].add_metric(labels, metrics["counters"][name])
            if hicache:
                for name, (_, (tier, key)) in (HICACHE_GAUGES | HICACHE_COUNTERS).items():
                    part = (st.hicache or {}).get(tier) or {}
                    families[name].add_metric(labels, part.get(key, 0))
            if disagg:
                for name in DISAGG_GAUGES:
                    families[name].add_metric(labels, (st.disagg or {}).get(name, 0))
            if qos:
                for name, (_, key) in QOS_COUNTERS.items():
                    families[name].add_metric(labels, (st.qos or {}).get(key, 0))
            for name in HISTOGRAMS:
                h = metrics["histograms"][name]
                cumulative, buckets = 0, []
                for bound, count in zip([*h["bounds"], float("inf")], h["counts"]):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
                families[name].add_metric(labels, buckets, h["sum"])
        yield from families.values()
        if self.tenants is not None:
            yield from self.tenant_families()

    def tenant_families(self):
        from prometheus_client.core import CounterMetricFamily

        labels = ["model_name", "tenant"]
        out = {n: CounterMetricFamily(PREFIX + n, doc, labels=labels) for n, (doc, _) in TENANT_COUNTERS.items()}
        rejected = CounterMetricFamily(
            PREFIX + "tenant_rejected_requests",
            "Requests refused with HTTP 429, per tenant and limit (rpm, tpm, max_concurrency)",
            labels=[*labels, "limit"],
        )
        for tenant, t in (self.tenants or {}).items():
            for name, (_, key) in TENANT_COUNTERS.items():
                out[name].add_metric([self.model_name, tenant], t[key])
            for limit, count in t["rejected"].items():
                rejected.add_metric([self.model_name, tenant, limit], count)
        yield from out.values()
        yield rejected


def render(model_name: str, scheduler_states: list[SchedulerState], tenants: dict | None = None) -> bytes:
    """The Prometheus text exposition of one scrape of the schedulers' states (and, with tenant
    limits, the HTTP process's per-tenant admission counters)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StateCollector(model_name, scheduler_states, tenants))
    return generate_latest(registry)
