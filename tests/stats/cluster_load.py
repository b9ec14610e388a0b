"""Load for the cluster tests: client threads sending KTAE requests with history and request
ids to a service, recording every answer (status, history per group, recorded, 503s retried);
and what a service process counted of its statistics writes."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

NAMESPACE = "cluster-run"
GROUPS = 8
ROLLOUTS = 3
# Rollouts a request counts in the statistics.
REQUEST_ROLLOUTS = GROUPS * ROLLOUTS


def prompts(count: int = 48) -> list[str]:
    return [f"prompt-{i}" for i in range(count)]


def request(request_id: str, seed: int, pool: list[str]) -> dict[str, Any]:
    rng = random.Random(seed)
    groups = []
    for prompt in rng.sample(pool, GROUPS):
        rollouts = [
            {"tokens": [rng.randrange(40) for _ in range(6)], "reward": float(r % 2)}
            for r in range(ROLLOUTS)
        ]
        groups.append({"id": prompt, "rollouts": rollouts})
    return {
        "request_id": request_id,
        "namespace": NAMESPACE,
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt"}},
        "groups": groups,
    }


@dataclass
class Answer:
    request_id: str
    status: int
    history: str | None = None
    groups: list[tuple[str, str | None]] = field(default_factory=list)
    recorded: bool | None = None
    retried_503: int = 0
    at: float = 0.0


@dataclass
class Load:
    """``clients`` threads, each sending requests one after the other until :meth:`stop`."""

    url: str | list[str]
    clients: int
    pool: list[str]
    tag: str
    answers: list[Answer] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(self.clients)
        ]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, index: int) -> None:
        base = self.url if isinstance(self.url, str) else self.url[index % len(self.url)]
        with httpx.Client(base_url=base, timeout=60.0) as client:
            n = 0
            while not self._stop.is_set():
                body = request(f"{self.tag}-{index}-{n}", hash((self.tag, index, n)), self.pool)
                n += 1
                answer = send(client, body)
                with self._lock:
                    self.sent.append(body)
                    self.answers.append(answer)

    def ok(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 200]


def send(client: httpx.Client, body: dict[str, Any], attempts: int = 20) -> Answer:
    """POST ``body``; a 503 (overloaded, draining, or a connection refused by a restarting
    replica behind the balancer) is retried after its hint, as the client library does."""
    retried = 0
    for _ in range(attempts):
        try:
            response = client.post("/v1/advantages", json=body)
        except httpx.TransportError:
            retried += 1
            time.sleep(0.2)
            continue
        if response.status_code == 503:
            retried += 1
            time.sleep(min(1.0, float(response.headers.get("retry-after", "0.2"))))
            continue
        answer = Answer(body["request_id"], response.status_code, retried_503=retried)
        answer.at = time.monotonic()
        if response.status_code == 200:
            data = response.json()
            answer.history = data["summary"]["history"]
            answer.recorded = data["summary"]["recorded"]
            answer.groups = [(g["id"], g.get("history")) for g in data["groups"]]
        return answer
    return Answer(body["request_id"], 503, retried_503=retried)


class Scraped(Protocol):
    """A service process whose metrics a test reads: ((name, labels), value)."""

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]: ...


def stats_outcomes(service: Scraped) -> dict[str, float]:
    """``advantage_stats_requests_total`` by outcome, the outcomes that happened."""
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in service.metrics().items()
        if name == "advantage_stats_requests_total" and value
    }


__all__ = ["REQUEST_ROLLOUTS", "Answer", "Load", "prompts", "request", "send", "stats_outcomes"]
