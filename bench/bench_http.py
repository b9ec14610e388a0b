"""End-to-end HTTP benchmark on the training-sized batch, next to in-process compute.

    python bench/bench_http.py [--device cpu|cuda] [--repeats 7] [--estimators grpo ktae]
                               [--stages]

Starts a real server process (``advantage-service serve``) on a free port and, interleaved in
rounds so machine noise hits every measure alike, times:

- in-process ``compute_batch`` on the same batch, in this process (the reference);
- ``POST /v1/advantages`` with a JSON body and a JSON answer, the answer parsed by
  ``orjson.loads`` (``json``), and again parsed as the client's ``compute`` gives it, its
  per-token lists as numpy float32 arrays (``json, as the client``);
- ``POST /v1/advantages`` with an Arrow IPC body and an Arrow answer.

Each goes through the client's transport for plain HTTP (advantage_client/http11.py), as
``HttpClient`` does; JSON and Arrow go through httpx's own transport as well (``..., httpx's
transport``), which the client used before, so that the two compare in one run.

End-to-end latency runs from sending an already-encoded body to holding the parsed answer
(as above / Arrow ``read_all``) in the client. Before each measure both processes are let go
quiet (bench/settle.py: the server writes statistics after its answer, and compute threads
spin a while after a parallel region). Prints the median and the best round,
tokens per second, and the ratio of each latency to the in-process compute time of the same
statistic (goals: Arrow <= 1.5x, JSON <= 5x), plus the server's own ``summary.compute_ms`` so
the transport's share is visible, and the median's ratio to it (a steadier reference than the
in-process median, which on a 2-core machine swings between runs). On a shared machine the best
round is the least disturbed.

``--stages`` prints instead where the JSON path's time goes, each stage run in this process on
the same body (this process's CPU time, which other processes on a shared machine disturb far
less than the wall clock): the body's bounds checked (wire/json_guard.py), the body decoded
(msgspec and the per-token arrays, wire/jsonio.py), ``parse_request`` (the batch built and
validated), the computation, the response encoded, and the client's ``orjson.loads`` of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_client.http11 import Http11Transport
from advantage_client.http_client import json_response_dict
from advantage_contract import arrow as contract_arrow
from advantage_service import RolloutBatch, compute_batch
from advantage_service.transports import arrow
from advantage_service.transports.http import encode_json
from advantage_service.wire import json_guard, jsonio
from advantage_service.wire.request import parse_request
from settle import settle
from synthetic import training_batch

ARROW = contract_arrow.MEDIA_TYPE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def json_body(batch: RolloutBatch, estimator: str) -> bytes:
    """The batch as the JSON request contract."""
    offsets = batch.offsets.numpy()
    tokens = np.split(batch.tokens.numpy(), offsets[1:-1])
    rewards = batch.rewards.tolist()
    sizes = batch.group_sizes.tolist()
    groups, start = [], 0
    for gid, size in zip(batch.group_ids, sizes, strict=True):
        rollouts = [
            {"tokens": tokens[i].tolist(), "reward": rewards[i]} for i in range(start, start + size)
        ]
        groups.append({"id": gid, "rollouts": rollouts})
        start += size
    return json.dumps({"estimator": estimator, "groups": groups}).encode()


class Server:
    def __init__(self, device: str, log: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ADV_")}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "advantage_service",
                    "serve",
                    "--http-port",
                    str(self.port),
                    "--grpc-port",
                    str(free_port()),
                    "--device",
                    device,
                    "--log-level",
                    "warning",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        url = f"http://127.0.0.1:{self.port}"
        # HttpClient's transport for plain HTTP, and httpx's own beside it for comparison.
        self.client = httpx.Client(base_url=url, timeout=300, transport=Http11Transport())
        self.httpx = httpx.Client(base_url=url, timeout=300)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {log.read_text()}")
            try:
                if self.client.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not become ready")
            time.sleep(0.1)

    def post(
        self,
        body: bytes,
        content_type: str,
        accept: str,
        as_client: bool = False,
        httpx_transport: bool = False,
    ) -> tuple[Any, float]:
        """(parsed answer, the server's compute_ms). ``as_client``: a JSON answer parsed as
        the client's ``compute`` gives it (per-token lists as numpy float32 arrays), not by
        ``orjson.loads`` alone. ``httpx_transport``: through httpx's own transport instead of
        the client's (advantage_client/http11.py)."""
        client = self.httpx if httpx_transport else self.client
        response = client.post(
            "/v1/advantages",
            content=body,
            headers={"content-type": content_type, "accept": accept},
        )
        if response.status_code != 200:
            raise SystemExit(f"{response.status_code}: {response.text[:500]}")
        if accept == ARROW:
            meta, table = arrow.read_response(response.content)
            return table, float(meta["summary"]["compute_ms"])
        parse = json_response_dict if as_client else orjson.loads
        answer = parse(response.content)
        return answer, float(answer["summary"]["compute_ms"])

    def stop(self) -> None:
        self.client.close()
        self.httpx.close()
        self.proc.terminate()
        self.proc.wait(30)


def interleaved(
    fns: dict[str, Callable[[], float | None]], repeats: int, pids: tuple[int, ...] = ()
) -> dict[str, tuple[float, float, float | None]]:
    """(median seconds, best seconds, median of what it returned: the server's compute ms) of
    each function over round-robin rounds, after one warm-up round; before each measure, this
    process and ``pids`` (the server's) quiet (:func:`settle.settle`)."""
    for fn in fns.values():
        fn()
    seconds: dict[str, list[float]] = {k: [] for k in fns}
    extra: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            # Let both processes go quiet (compute threads spin a while after a parallel
            # region; the server writes statistics after its answer), so that no measure pays
            # for another's leftovers.
            settle(*pids)
            start = time.perf_counter()
            value = fn()
            seconds[name].append(time.perf_counter() - start)
            if value is not None:
                extra[name].append(value)
    return {
        k: (
            statistics.median(seconds[k]),
            min(seconds[k]),
            statistics.median(extra[k]) if extra[k] else None,
        )
        for k in fns
    }


def stages(batch: RolloutBatch, estimator: str, device: torch.device, repeats: int) -> None:
    """The JSON path's stages in this process: median and least CPU ms of each."""
    body = json_body(batch, estimator)
    limits = jsonio.BodyLimits(max_tokens=batch.num_tokens, max_rollouts=batch.num_rollouts)
    jsonio.compile_readers()
    obj = jsonio.loads_request(body, limits)
    req = parse_request(obj)
    computed = compute_batch(req.batch, estimator, device, diagnostics=())
    answer = encode_json(req, computed, {"compute_ms": 0.0})
    steps: dict[str, Callable[[], object]] = {
        "bounds (json_guard)": lambda: json_guard.check_body(body, limits),
        "decode (loads_request, bounds included)": lambda: jsonio.loads_request(body, limits),
        "parse_request": lambda: parse_request(obj),
        "compute": lambda: compute_batch(
            dataclasses.replace(req.batch), estimator, device, diagnostics=()
        ),
        "encode (encode_json)": lambda: encode_json(req, computed, {"compute_ms": 0.0}),
        "client orjson.loads": lambda: orjson.loads(answer),
    }
    print(f"{estimator}: {len(body) / 1e6:.1f} MB body, {len(answer) / 1e6:.1f} MB answer")
    print("| stage | median CPU ms | least CPU ms |\n|---|---|---|")
    for name, step in steps.items():
        spent = []
        for _ in range(repeats):
            start = time.process_time()
            step()
            spent.append(time.process_time() - start)
        print(f"| {name} | {statistics.median(spent) * 1000:.1f} | {min(spent) * 1000:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--estimators", nargs="+", default=["grpo", "ktae"])
    parser.add_argument("--stages", action="store_true", help="the JSON path's stages instead")
    args = parser.parse_args()
    device = torch.device(args.device)

    batch = training_batch(seed=0)
    if args.stages:
        for estimator in args.estimators:
            stages(batch, estimator, device, args.repeats)
        return 0
    n = batch.num_tokens
    print(
        f"batch: {batch.num_groups} groups x {batch.num_rollouts // batch.num_groups} rollouts, "
        f"{n:,} tokens; device {args.device}; {torch.get_num_threads()} torch threads; "
        f"median of {args.repeats} interleaved rounds"
    )
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(args.device, Path(tmp) / "server.log")
        try:
            rows = []
            for estimator in args.estimators:
                body_json = json_body(batch, estimator)
                body_arrow = arrow.write_stream(
                    arrow.request_table(batch, {"estimator": estimator})
                ).to_pybytes()

                def in_process(est: str = estimator) -> None:
                    # A fresh batch object, as each request is: no cached derived tensors.
                    compute_batch(dataclasses.replace(batch), est, device, diagnostics=())
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)

                def via_json(body: bytes = body_json) -> float:
                    return server.post(body, "application/json", "application/json")[1]

                def via_json_httpx(body: bytes = body_json) -> float:
                    return server.post(
                        body, "application/json", "application/json", httpx_transport=True
                    )[1]

                def via_json_client(body: bytes = body_json) -> float:
                    return server.post(body, "application/json", "application/json", True)[1]

                def via_arrow(body: bytes = body_arrow) -> float:
                    return server.post(body, ARROW, ARROW)[1]

                def via_arrow_httpx(body: bytes = body_arrow) -> float:
                    return server.post(body, ARROW, ARROW, httpx_transport=True)[1]

                paths = {
                    "in-process": in_process,
                    "json": via_json,
                    "json, httpx's transport": via_json_httpx,
                    "json, as the client": via_json_client,
                    "arrow": via_arrow,
                    "arrow, httpx's transport": via_arrow_httpx,
                }
                times = interleaved(
                    paths,
                    args.repeats,
                    (server.proc.pid,),
                )
                median_ref, best_ref, _ = times["in-process"]
                for name, (median, best, server_ms) in times.items():
                    size = len(body_arrow) if name.startswith("arrow") else len(body_json)
                    size = None if name == "in-process" else size
                    rows.append(
                        (estimator, name, median, best, median_ref, best_ref, server_ms, size)
                    )
        finally:
            server.stop()

    header = (
        "estimator",
        "path",
        "median ms",
        "best ms",
        "M tokens/s",
        "x in-process (median)",
        "x in-process (best)",
        "server compute ms",
        "x server compute (median)",
        "request MB",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for estimator, name, median, best, median_ref, best_ref, server_ms, size in rows:
        cells = [
            estimator,
            name,
            f"{median * 1000:.1f}",
            f"{best * 1000:.1f}",
            f"{n / median / 1e6:.1f}",
            f"{median / median_ref:.2f}",
            f"{best / best_ref:.2f}",
            "" if server_ms is None else f"{server_ms:.1f}",
            "" if not server_ms else f"{median / (server_ms / 1000):.2f}",
            "" if size is None else f"{size / 1e6:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
