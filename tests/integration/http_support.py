"""Helpers for the integration tests: real server processes and request builders.

``python -m advantage_service serve`` on free ports with ``ADV_*`` settings, waited for by
polling ``/readyz``, stopped with SIGTERM (then SIGKILL). The request builders do not use the
service's own encoders, so a symmetric codec bug cannot hide.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
from advantage_service import presets
from process_support import ServiceProcess, launch_service
from request_support import (
    content_key,
    diagnostics_for,
    random_groups,
    uses_components,
    uses_token_inputs,
)

ARROW = "application/vnd.apache.arrow.stream"

# The shared server's limits: small enough that the limit tests stay cheap.
SHARED_SETTINGS = {
    "max_request_tokens": 20_000,
    "max_group_size": 32,
    "max_body_bytes": 1_000_000,
    "max_inflight": 4,
}


class Server(ServiceProcess):
    """One running service process (HTTP at ``url``; ``client`` talks to it)."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        url = f"http://127.0.0.1:{port}"
        super().__init__(proc, url, log, httpx.Client(base_url=url, timeout=60.0))
        self.port = port
        self.client = self.http


def start_server(directory: Path, **settings: Any) -> Server:
    proc, port, _, log = launch_service(directory, settings)
    server = Server(proc, port, log)
    server.ready_or_killed()
    return server


# ---- requests -----------------------------------------------------------------------------------


def random_request(
    seed: int, estimator: str | dict[str, Any] = "grpo", groups: int = 4
) -> dict[str, Any]:
    """A JSON request with logprobs and pos/neg teacher log-probs on every rollout (so every
    preset applies; entropy, sum_pi_squared, is_weights and planning_mask too for an estimator
    that reads them), mixed and zero-signal groups, and every diagnostic asked for."""
    with_token_inputs = uses_token_inputs(estimator)
    return {
        # (One id per content: an id sent again with another body is a 409 conflict.)
        "request_id": f"req-{seed}-{content_key(estimator, groups)}",
        "estimator": estimator,
        "ignore_token_ids": [0],
        "return": diagnostics_for(estimator),
        "groups": random_groups(
            seed,
            groups,
            with_token_inputs=with_token_inputs,
            vocab=500,
            with_components=uses_components(estimator),
        ),
    }


def arrow_request(request: dict[str, Any], order: list[int] | None = None) -> bytes:
    """The JSON request as an Arrow IPC stream, built row by row with plain pyarrow.

    ``order`` permutes the rows (to send a group's rollouts non-contiguously).
    """
    rows = [(g["id"], r) for g in request["groups"] for r in g["rollouts"]]
    if order is not None:
        rows = [rows[i] for i in order]
    columns: dict[str, pa.Array] = {
        "group_id": pa.array([gid for gid, _ in rows], pa.string()),
        "reward": pa.array([r["reward"] for _, r in rows], pa.float64()),
        "tokens": pa.array([r["tokens"] for _, r in rows], pa.list_(pa.int32())),
    }
    for name in ("logprobs", "entropy", "sum_pi_squared", "is_weights", "planning_mask"):
        if rows and name in rows[0][1]:
            columns[name] = pa.array([r[name] for _, r in rows], pa.list_(pa.float32()))
    for name in sorted(rows[0][1].get("teacher_logprobs", {}) if rows else ()):
        columns[f"teacher.{name}"] = pa.array(
            [r["teacher_logprobs"][name] for _, r in rows], pa.list_(pa.float32())
        )
    for name in sorted(rows[0][1].get("reward_components", {}) if rows else ()):
        columns[f"component.{name}"] = pa.array(
            [r["reward_components"][name] for _, r in rows], pa.float64()
        )
    options = {k: v for k, v in request.items() if k != "groups"}
    table = pa.table(columns).replace_schema_metadata({"advantage.request": json.dumps(options)})
    return stream_bytes(table)


def stream_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def read_arrow(body: bytes) -> tuple[dict[str, Any], pa.Table]:
    with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
        table = reader.read_all()
    return json.loads(table.schema.metadata[b"advantage.response"]), table


ALL_PRESETS = sorted(presets())
