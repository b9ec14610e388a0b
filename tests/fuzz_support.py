"""Hypothesis settings shared by the fuzz tests (HTTP, gRPC, Arrow)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings


def bounded(examples: int, derandomize: bool = True, **extra: Any) -> settings:
    """``examples`` examples, no deadline (a service under test answers when it can), no example
    database (runs do not depend on earlier runs), reproducible unless ``derandomize`` is off,
    and no health check (the strategies are slow on purpose: they build whole requests)."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        **extra,
    )
