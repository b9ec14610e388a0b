"""Sustained load on a running service: client threads over HTTP (Arrow) and gRPC (unary and
streaming), every answer classified, and the server's RSS sampled.

Used by ``bench/bench_load.py`` (the 60 s run with fault injections) and by the short fault
tests in ``tests/reliability``. Requests are encoded once up front, so the clients spend their
time waiting on the service, not encoding (client and server share the machine's cores).

An answer is ``ok`` (HTTP 200, gRPC OK, a stream that answered every group), ``refused`` (a
request sent after the shutdown signal and turned away cleanly: connection refused or reset,
HTTP 503, gRPC UNAVAILABLE or CANCELLED) or ``failed`` (anything else, and any refusal before
the signal).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pyarrow as pa
from advantage_client.grpc_client import (
    CHANNEL_OPTIONS,
    compute_request_message,
    options_message,
    rollout_message,
)
from advantage_client.http_client import arrow_request_body
from advantage_contract import arrow as contract_arrow
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc

ARROW = contract_arrow.MEDIA_TYPE
KINDS = ("http", "grpc", "http", "grpc_stream")
# After the shutdown signal: UNAVAILABLE (the server refused the call, or its port is closed),
# and CANCELLED for a call that reached the server in the instant its gRPC server began to stop
# (gRPC cancels such calls without handing them to the service; they were never computed).
REFUSED_GRPC = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
VOCAB = 151_936


@dataclass(frozen=True)
class Shape:
    """A batch: ``groups`` x ``rollouts``, lengths uniform around ``tokens`` (0.5x to 1.5x)."""

    groups: int = 8
    rollouts: int = 8
    tokens: int = 512


@dataclass
class Result:
    kind: str
    started: float
    ended: float
    outcome: str  # ok | refused | failed
    detail: str
    history: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def make_request(
    seed: int, shape: Shape, *, estimator: Any, namespace: str, prompts: int
) -> dict[str, Any]:
    """A request with Zipf token ids, mixed rewards, and group ids from a pool of ``prompts``
    (training revisits prompts: history and statistics stay bounded by the pool)."""
    rng = np.random.default_rng(seed)
    groups = []
    ids = rng.choice(prompts, size=shape.groups, replace=False)
    for g in range(shape.groups):
        lengths = rng.integers(shape.tokens // 2, shape.tokens * 3 // 2 + 1, shape.rollouts)
        rewards = rng.integers(0, 2, shape.rollouts).astype(float)
        groups.append(
            {
                "id": f"prompt-{ids[g]}",
                "rollouts": [
                    {
                        "tokens": (rng.zipf(1.3, int(n)) % VOCAB).astype(np.int32),
                        "reward": float(r),
                    }
                    for n, r in zip(lengths, rewards, strict=True)
                ],
            }
        )
    return {"namespace": namespace, "estimator": estimator, "groups": groups}


@dataclass
class Payloads:
    """One request pre-encoded for each client kind."""

    http: bytes
    grpc: pb.ComputeRequest
    stream: list[pb.StreamRequest]
    groups: int

    @classmethod
    def of(cls, request: Mapping[str, Any]) -> Payloads:
        messages = [
            pb.StreamRequest(
                options=options_message(
                    namespace=request["namespace"], estimator=request["estimator"]
                )
            )
        ]
        for group in request["groups"]:
            for i, rollout in enumerate(group["rollouts"]):
                message = rollout_message(
                    {
                        "group_id": group["id"],
                        "group_size": len(group["rollouts"]),
                        "rollout_id": f"{group['id']}/{i}",
                        **rollout,
                    }
                )
                messages.append(pb.StreamRequest(rollout=message))
        return cls(
            http=arrow_request_body(request),
            grpc=compute_request_message(request),
            stream=messages,
            groups=len(request["groups"]),
        )


@dataclass
class LoadConfig:
    http_url: str
    grpc_target: str
    clients: int = 16
    shape: Shape = field(default_factory=Shape)
    estimator: Any = "ktae"
    namespace: str = "load"
    token: str | None = None
    prompts: int = 256
    distinct_requests: int = 8
    timeout: float = 120.0


class Load:
    """Client threads sending requests back to back until :meth:`stop`."""

    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self.payloads = [
            Payloads.of(
                make_request(
                    seed,
                    config.shape,
                    estimator=config.estimator,
                    namespace=config.namespace,
                    prompts=config.prompts,
                )
            )
            for seed in range(config.distinct_requests)
        ]
        self.results: list[Result] = []
        self.shutdown_at: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._headers = {"content-type": ARROW, "accept": ARROW}
        self._metadata: tuple[tuple[str, str], ...] = ()
        if config.token is not None:
            self._headers["authorization"] = f"Bearer {config.token}"
            self._metadata = (("authorization", f"Bearer {config.token}"),)

    # ---- running ----------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.config.clients):
            kind = KINDS[i % len(KINDS)]
            thread = threading.Thread(target=self._client, args=(i, kind), daemon=True)
            thread.start()
            self._threads.append(thread)

    def mark_shutdown(self) -> None:
        """Call just before signalling the server: later refusals are not failures."""
        self.shutdown_at = time.monotonic()

    def stop(self, timeout: float = 180.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def _client(self, index: int, kind: str) -> None:
        requests = self._requests(index)
        with (
            httpx.Client(base_url=self.config.http_url, timeout=self.config.timeout) as http,
            grpc.insecure_channel(self.config.grpc_target, options=CHANNEL_OPTIONS) as channel,
        ):
            stub = pb_grpc.AdvantageServiceStub(channel)
            while not self._stop.is_set():
                payload = next(requests)
                started = time.monotonic()
                if kind == "http":
                    result = self._http(http, payload, started)
                elif kind == "grpc":
                    result = self._grpc(stub, payload, started)
                else:
                    result = self._stream(stub, payload, started)
                self.results.append(result)
                if result.outcome != "ok":
                    time.sleep(0.05)  # a refused client does not spin

    def _requests(self, index: int) -> Iterator[Payloads]:
        n = len(self.payloads)
        i = index
        while True:
            yield self.payloads[i % n]
            i += 1

    def _refusal(self, started: float) -> str:
        after = self.shutdown_at is not None and started >= self.shutdown_at
        return "refused" if after else "failed"

    def _http(self, http: httpx.Client, payload: Payloads, started: float) -> Result:
        try:
            answer = http.post("/v1/advantages", content=payload.http, headers=self._headers)
        except httpx.TransportError as exc:
            outcome = self._refusal(started)
            return Result("http", started, time.monotonic(), outcome, type(exc).__name__)
        ended = time.monotonic()
        if answer.status_code == 200:
            with pa.ipc.open_stream(pa.py_buffer(answer.content)) as reader:
                meta = json.loads((reader.schema.metadata or {})[b"advantage.response"])
            return Result("http", started, ended, "ok", "200", (meta["summary"]["history"],))
        outcome = self._refusal(started) if answer.status_code == 503 else "failed"
        return Result("http", started, ended, outcome, f"{answer.status_code} {answer.text[:200]}")

    def _grpc(self, stub: Any, payload: Payloads, started: float) -> Result:
        try:
            response = stub.Compute(
                payload.grpc, timeout=self.config.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            outcome = self._refusal(started) if code in REFUSED_GRPC else "failed"
            detail = f"{code.name} {exc.details()}"  # type: ignore[attr-defined]
            return Result("grpc", started, time.monotonic(), outcome, detail)
        return Result("grpc", started, time.monotonic(), "ok", "OK", (response.summary.history,))

    def _stream(self, stub: Any, payload: Payloads, started: float) -> Result:
        try:
            responses = list(
                stub.StreamCompute(
                    iter(payload.stream), timeout=self.config.timeout, metadata=self._metadata
                )
            )
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            outcome = self._refusal(started) if code in REFUSED_GRPC else "failed"
            detail = f"{code.name} {exc.details()}"  # type: ignore[attr-defined]
            return Result("grpc_stream", started, time.monotonic(), outcome, detail)
        ended = time.monotonic()
        errors = [r.error.error.message for r in responses if r.WhichOneof("kind") == "error"]
        if errors or len(responses) != payload.groups:
            detail = f"{len(responses)} answers for {payload.groups} groups; errors {errors[:3]}"
            return Result("grpc_stream", started, ended, "failed", detail)
        history = tuple(r.result.summary.history for r in responses)
        return Result("grpc_stream", started, ended, "ok", "OK", history)


# ---- the server's memory ------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (Linux /proc), None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Samples a process's RSS every ``interval`` seconds on a thread: (monotonic time, bytes)."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes(self.pid)
            if rss is None:
                return
            self.samples.append((time.monotonic(), rss))
            self._stop.wait(self.interval)


# ---- summaries ----------------------------------------------------------------------------------


def summarize(
    results: list[Result], start: float, end: float, shutdown_at: float | None = None
) -> dict[str, Any]:
    """Counts, latency percentiles and throughput of the ok answers, by kind and overall."""
    ok = [r for r in results if r.outcome == "ok"]
    window = [r for r in ok if shutdown_at is None or r.started < shutdown_at]
    span = (shutdown_at or end) - start

    def stats(rs: list[Result]) -> dict[str, Any]:
        ms = np.array([1000.0 * r.seconds for r in rs]) if rs else np.zeros(1)
        return {
            "answered": len(rs),
            "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "max_ms": round(float(ms.max()), 1),
            "per_s": round(len(rs) / span, 2) if span > 0 else 0.0,
        }

    before = [r for r in results if shutdown_at is None or r.started < shutdown_at]
    return {
        "seconds": round(end - start, 1),
        "outcomes": dict(Counter(r.outcome for r in results)),
        "before_shutdown_not_ok": sum(r.outcome != "ok" for r in before),
        "failures": [f"{r.kind}: {r.detail}" for r in results if r.outcome == "failed"][:10],
        "refusals": dict(
            Counter(r.detail.split(" ")[0] for r in results if r.outcome == "refused")
        ),
        "history": dict(Counter(h for r in ok for h in r.history)),
        "all": stats(window),
        **{kind: stats([r for r in window if r.kind == kind]) for kind in sorted(set(KINDS))},
    }


def rss_summary(samples: list[tuple[float, int]], warm_from: float) -> dict[str, Any]:
    """RSS in MiB: at the end of warm-up (first sample at or after ``warm_from``), the peak
    after it, and the last sample."""
    mib = 1024 * 1024
    after = [rss for t, rss in samples if t >= warm_from] or [rss for _, rss in samples]
    t0 = samples[0][0] if samples else 0.0
    every = max(1, len(samples) // 12)
    return {
        "start_mib": round(after[0] / mib, 1),
        "peak_mib": round(max(after) / mib, 1),
        "end_mib": round(after[-1] / mib, 1),
        "first_mib": round(samples[0][1] / mib, 1) if samples else 0.0,
        # (seconds into the run, MiB), about a dozen points: the shape of the curve.
        "timeline": [(round(t - t0), round(rss / mib)) for t, rss in samples[::every]],
    }
