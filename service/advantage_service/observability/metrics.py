"""Every Prometheus metric the service exports (ARCHITECTURE.md, "Metric names").

The metrics live on a registry the application owns, so several instances (tests, an embedded
engine) never collide on the process-global default registry.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# Seconds: from a tiny request on a GPU to a training-sized KTAE batch on a CPU.
DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# Fraction of correct rollouts in a group: 0 and 1 are the zero-signal extremes.
ACCURACY_BUCKETS = tuple(round(0.1 * i, 1) for i in range(11))
# Token advantages: symmetric, fine near zero where KTAE bonuses and normalised GRPO values live.
ADVANTAGE_BUCKETS = (
    -10.0,
    -5.0,
    -3.0,
    -2.0,
    -1.0,
    -0.5,
    -0.25,
    -0.1,
    -0.01,
    0.0,
    0.01,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    3.0,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
STATS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Token advantages observed per request: an evenly strided sample keeps the cost near 1 ms.
TOKEN_SAMPLE = 4096


class BulkHistogram(Collector):
    """A histogram observed with whole numpy arrays at once (one vectorised count per call,
    not one Python call per value), exported in the standard histogram format."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = np.asarray(sorted(buckets), dtype=np.float64)
        self._lock = threading.Lock()
        # label values -> (per-bucket counts incl. +Inf, sum)
        self._series: dict[tuple[str, ...], tuple[np.ndarray, float]] = {}
        if registry is not None:
            registry.register(self)

    def observe_many(self, values: np.ndarray, *labelvalues: str) -> None:
        """Count every value of ``values`` (any shape; NaN values are skipped)."""
        if len(labelvalues) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}")
        flat = np.asarray(values, dtype=np.float64).ravel()
        flat = flat[~np.isnan(flat)]
        # Prometheus buckets are "less than or equal": a value equal to a bound counts there.
        counts = np.bincount(
            np.searchsorted(self.bounds, flat, side="left"), minlength=self.bounds.size + 1
        )
        total = float(flat.sum())
        with self._lock:
            old, old_sum = self._series.get(
                labelvalues, (np.zeros(self.bounds.size + 1, np.int64), 0.0)
            )
            self._series[labelvalues] = (old + counts, old_sum + total)

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            series = dict(self._series)
        for labelvalues, (counts, total) in series.items():
            cumulative = np.cumsum(counts)
            buckets = [
                (_le(b), float(c)) for b, c in zip(self.bounds, cumulative[:-1], strict=True)
            ]
            buckets.append(("+Inf", float(cumulative[-1])))
            family.add_metric(list(labelvalues), buckets, total)
            if self.bounds[0] < 0:
                # prometheus_client drops _sum and _count when a bucket bound is negative (an
                # OpenMetrics rule); the text format keeps them, and sum/count is the mean.
                labels = dict(zip(self.labelnames, labelvalues, strict=True))
                family.samples.append(Sample(self.name + "_count", labels, float(cumulative[-1])))
                family.samples.append(Sample(self.name + "_sum", labels, total))
        yield family


def _le(bound: float) -> str:
    return repr(float(bound))


class Metrics:
    """The service's metrics on one registry (a fresh one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if process:
            ProcessCollector(registry=r)
        self.requests_total = Counter(
            "advantage_requests_total",
            "Requests answered, by transport, estimator label and status code",
            ["transport", "estimator", "code"],
            registry=r,
        )
        self.request_errors_total = Counter(
            "advantage_request_errors_total",
            "Requests rejected, by transport and error code (invalid_json, limit_exceeded, ...)",
            ["transport", "error"],
            registry=r,
        )
        self.request_duration_seconds = Histogram(
            "advantage_request_duration_seconds",
            "Time from admission to an encoded response (decode, compute, encode)",
            ["transport", "estimator"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.compute_duration_seconds = Histogram(
            "advantage_compute_duration_seconds",
            "Time in the estimator pipeline alone",
            ["estimator", "device"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.tokens_total = Counter(
            "advantage_tokens_total", "Tokens computed", ["estimator"], registry=r
        )
        self.rollouts_total = Counter("advantage_rollouts_total", "Rollouts computed", registry=r)
        self.groups_total = Counter(
            "advantage_groups_total",
            "Groups computed; signal=zero: every rollout had the same reward (no GRPO signal)",
            ["signal"],
            registry=r,
        )
        self.group_accuracy = BulkHistogram(
            "advantage_group_accuracy",
            "Fraction of a group's rollouts with reward > 0",
            ACCURACY_BUCKETS,
            registry=r,
        )
        self.token_advantage = BulkHistogram(
            "advantage_token_advantage",
            f"Token advantages (an evenly strided sample of at most {TOKEN_SAMPLE} per request)",
            ADVANTAGE_BUCKETS,
            ["estimator"],
            registry=r,
        )
        self.inflight_requests = Gauge(
            "advantage_inflight_requests",
            "Requests admitted and not yet answered (being received, waiting or computing)",
            registry=r,
        )
        self.max_inflight = Gauge(
            "advantage_max_inflight", "Computations at once (ADV_MAX_INFLIGHT workers)", registry=r
        )
        self.max_queue = Gauge(
            "advantage_max_queue", "Requests the replica holds at most (ADV_MAX_QUEUE)", registry=r
        )
        self.queue_depth = Gauge(
            "advantage_queue_depth", "Requests decoded and waiting for a compute worker", registry=r
        )
        self.queue_wait_seconds = Histogram(
            "advantage_queue_wait_seconds",
            "Time from admission to the start of a request's computation (body, decode, queue)",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "advantage_batch_requests",
            "Requests computed together in one computation (dynamic batching)",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.stats_store_errors_total = Counter(
            "advantage_stats_store_errors_total",
            "Stats store operations that failed",
            ["op"],
            registry=r,
        )
        self.stats_store_duration_seconds = Histogram(
            "advantage_stats_store_duration_seconds",
            "Stats store operation time",
            ["op"],
            buckets=STATS_BUCKETS,
            registry=r,
        )
        self.stats_requests_total = Counter(
            "advantage_stats_requests_total",
            "Answered requests by what became of their statistics: counted (written); "
            "duplicate (their request id was counted before); lost (accepted, answered "
            "recorded=true, then the store failed, refused their write on its own (see "
            "advantage_stats_poisoned_total) or the service stopped before the write); "
            "refused (answered recorded=false: the store unreachable, or shutting down); "
            "conflict (their request id was counted before for a different request)",
            ["outcome"],
            registry=r,
        )
        # Every outcome exported from the start (at 0), so that a rate over "lost|refused" is
        # 0 on a healthy service rather than no data, and an alert or panel reads a value.
        for outcome in ("counted", "duplicate", "lost", "refused", "conflict"):
            self.stats_requests_total.labels(outcome)
        self.stats_poisoned_total = Counter(
            "advantage_stats_poisoned_total",
            "Answered requests whose statistics the store could not take on their own (a key or "
            "request id that is not valid text, a record refused, writes that could not be "
            "built): not written, the other requests of their write round written without "
            'them; also counted in advantage_stats_requests_total{outcome="lost"}',
            registry=r,
        )
        self.stats_write_backlog = Gauge(
            "advantage_stats_write_backlog",
            "Requests whose statistics were accepted and are not yet written; at "
            "ADV_STATS_MAX_BACKLOG no computation starts (pushback)",
            registry=r,
        )
        self.stats_write_round_requests = Histogram(
            "advantage_stats_write_round_requests",
            "Requests whose statistics one write round coalesced",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.stats_store_up = Gauge(
            "advantage_stats_store_up", "1 when the stats store answered its last call", registry=r
        )
        self.stats_store_round_trips_total = Counter(
            "advantage_stats_store_round_trips_total",
            "Pipelines the stats store sent to Redis nodes (one per node an operation touches: "
            "on a Redis Cluster a read or write fans out to the masters of its slots)",
            registry=r,
        )
        self.stats_store_degraded = Gauge(
            "advantage_stats_store_degraded",
            "1 while part of the stats store does not answer (a Redis Cluster master down: the "
            "history of its slots is unavailable until its replica takes over)",
            registry=r,
        )
        self.stream_open = Gauge(
            "advantage_stream_open", "Open gRPC StreamCompute calls", registry=r
        )
        self.stream_pending_groups = Gauge(
            "advantage_stream_pending_groups",
            "Groups received on streams and not yet complete",
            registry=r,
        )
        self.tenant_held = Gauge(
            "advantage_tenant_held",
            "What each tenant holds now: bodies being received, requests admitted, bytes "
            "(bodies and streams' pending rollouts), open streams (tenant: the token's name; "
            "anonymous on an open service)",
            ["tenant", "resource"],
            registry=r,
        )
        self.tenant_refusals_total = Counter(
            "advantage_tenant_refusals_total",
            "Refusals (503) because the replica's or the tenant's limit of a resource was "
            "reached, by tenant and resource",
            ["tenant", "resource"],
            registry=r,
        )
        self.http_pending_connections = Gauge(
            "advantage_http_pending_connections",
            "HTTP connections whose request headers have not arrived whole (new, or kept alive "
            "between requests)",
            registry=r,
        )
        self.http_connections_closed_total = Counter(
            "advantage_http_connections_closed_total",
            "HTTP connections the service closed: header_timeout (headers not whole within "
            "ADV_HEADER_TIMEOUT_SECONDS), pending_full (the oldest of ADV_MAX_PENDING_CONNECTIONS "
            "connections still sending headers, closed for a new one), headers_too_large (431)",
            ["reason"],
            registry=r,
        )
        for reason in ("header_timeout", "pending_full", "headers_too_large"):
            self.http_connections_closed_total.labels(reason)
        self.auth_reloads_total = Counter(
            "advantage_auth_reloads_total",
            "Reloads of the tokens file after a change; outcome=error: it did not parse and the "
            "previous tokens stay in force",
            ["outcome"],
            registry=r,
        )
        self.auth_tokens = Gauge(
            "advantage_auth_tokens", "Bearer tokens in force (0 without a tokens file)", registry=r
        )
        self.build_info = Gauge(
            "advantage_build_info",
            "Constant 1, labelled with the version and the compute device",
            ["version", "device"],
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
