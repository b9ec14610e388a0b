"""The service's parts built from its settings and wired to its metrics: the stats store and
the authenticator. The engine takes them ready-made (tests hand it their own)."""

from __future__ import annotations

from ..config import Settings
from ..observability.metrics import Metrics
from ..stats import StatsStore, make_store
from .auth import Authenticator


def stats_store(settings: Settings, metrics: Metrics) -> StatsStore:
    """The Redis store when ``ADV_REDIS_URL`` is set (its errors, timings and reachability in
    the metrics), else the embedded in-memory one."""
    if not settings.redis_url:
        metrics.stats_store_up.set(1)
        return make_store(None, ttl_seconds=settings.stats_ttl_seconds)
    store = make_store(
        settings.redis_url,
        ttl_seconds=settings.stats_ttl_seconds,
        cluster=settings.redis_cluster,
        buckets=settings.redis_cluster_buckets,
        on_error=lambda op: metrics.stats_store_errors_total.labels(op).inc(),
        on_duration=lambda op, sec: metrics.stats_store_duration_seconds.labels(op).observe(sec),
        on_up=lambda up: metrics.stats_store_up.set(1 if up else 0),
        on_round_trip=metrics.stats_store_round_trips_total.inc,
    )
    metrics.stats_store_degraded.set_function(lambda: float(store.status == "degraded"))
    return store


def authenticator(settings: Settings, metrics: Metrics) -> Authenticator:
    """The bearer-token authenticator of ``ADV_AUTH_TOKENS_FILE`` (open without one). Raises
    ``TokensFileError`` for a bad tokens file: the service must not start open by mistake."""
    return Authenticator(
        settings.auth_tokens_file,
        reload_seconds=settings.auth_reload_seconds,
        on_reload=lambda outcome: metrics.auth_reloads_total.labels(outcome).inc(),
        on_tokens=metrics.auth_tokens.set,
    )


__all__ = ["authenticator", "stats_store"]
