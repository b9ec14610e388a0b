"""What large bodies cost a real service: time to the answer and the growth of its peak RSS
(VmHWM), as a multiple of the body's bytes, for bodies at and over the limits.

    python bench/bench_bodies.py [--cases refused_by_tokens,refused_by_bytes,at_the_limit,...]

A fresh service process per case (on its defaults: ADV_MAX_BODY_BYTES 256 MiB,
ADV_MAX_REQUEST_TOKENS 8,388,608), its VmHWM read before and after one request:

- ``refused_by_tokens``: 240 MB of JSON holding 120 M token ids (under the body limit, 14x over
  the token limit): refused 413 from the arrays' commas, before any number is parsed;
- ``refused_by_bytes``: a body 10x the body limit (2.68 GB) declared by Content-Length: refused
  413 at once, the rest of the body read and dropped so the client gets the answer;
- ``refused_chunked``: the same 2.68 GB sent chunked, without Content-Length: refused 413 as
  soon as the bytes received pass the limit;
- ``read_at_the_limit``: 256 MiB (the limit) of bytes that are no Arrow stream, declared by
  Content-Length: read whole, then refused 422 by the decoder at its first bytes, so the growth
  is what reading the body costs;
- ``at_the_limit``: 8 M tokens with log-probs and a teacher condition in ~215 MB of JSON, GRPO:
  accepted and computed (the growth includes what the computation itself needs: the batch's
  tensors and the answer, about 0.25 GB here);
- ``viewer_by_bytes`` and ``viewer_chunked``: 300 MB to ``POST /viewer/api/diagnostics``, with
  and without Content-Length (the viewer's routes take at most 2 MiB).

The goals (the hardening issue): a refused body costs at most 2x its bytes and is answered in
under 1 s per 100 MB; an accepted one at most 4x its bytes beyond what its computation needs;
over HTTP, reading a body costs at most 2x its bytes + 16 MiB with the decoders.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from service_process import ServiceProcess

MB = 1_000_000


def vm_hwm(pid: int) -> int:
    """Peak resident set size of the process, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def post(
    url: str,
    chunks: list[bytes],
    length: int,
    *,
    path: str = "/v1/advantages",
    content_type: str = "application/json",
    chunked: bool = False,
) -> tuple[int, float]:
    """POST the chunks (``length`` bytes in all) over a raw socket, all sent before the answer
    is read, as most clients do (``chunked``: with Transfer-Encoding: chunked instead of
    Content-Length); (status, seconds to the answer)."""
    host, port = url.removeprefix("http://").split(":")
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
        f"{framing}\r\nConnection: close\r\n\r\n"
    ).encode()
    started = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.sendall(head)
        for chunk in chunks:
            if chunked:
                sock.sendall(b"%x\r\n" % len(chunk))
            sock.sendall(chunk)
            if chunked:
                sock.sendall(b"\r\n")
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        data = b""
        while chunk := sock.recv(1 << 20):
            data += chunk
    return int(data.split(b" ", 2)[1]), time.perf_counter() - started


def tokens_only(count: int) -> list[bytes]:
    """A request of one rollout of ``count`` token ids (``1,`` each): 2 bytes per token."""
    head = b'{"estimator":"grpo","groups":[{"id":"g","rollouts":[{"reward":1,"tokens":['
    block = b"1," * 1_000_000
    body = [head] + [block] * (count // 1_000_000)
    body.append(b"1" + b']},{"reward":0,"tokens":[2]}]}]}')
    return body


def at_the_limit(count: int) -> list[bytes]:
    """``count`` tokens in 64 rollouts of 8 groups, with log-probs and a teacher condition."""
    per = count // 64
    tokens = b",".join([b"123456"] * per)
    floats = b",".join([b"-1.234567"] * per)
    groups = []
    for g in range(8):
        rollouts = [
            b'{"reward":%d,"tokens":[%s],"logprobs":[%s],"teacher_logprobs":{"pos":[%s]}}'
            % (r % 2, tokens, floats, floats)
            for r in range(8)
        ]
        groups.append(b'{"id":"g%d","rollouts":[%s]}' % (g, b",".join(rollouts)))
    return [b'{"estimator":"grpo","return":[],"groups":[', b",".join(groups), b"]}"]


def run(case: str) -> dict[str, float | int | str]:
    options: dict[str, Any] = {}
    if case == "refused_by_tokens":
        chunks = tokens_only(120_000_000)
    elif case in ("refused_by_bytes", "refused_chunked"):
        chunks = [b" " * (64 * 2**20)] * 40  # 10x the 256 MiB limit
        options["chunked"] = case == "refused_chunked"
    elif case == "read_at_the_limit":
        chunks = [b"\x00" * (64 * 2**20)] * 4
        options["content_type"] = "application/vnd.apache.arrow.stream"
    elif case in ("viewer_by_bytes", "viewer_chunked"):
        chunks = [b" " * (50 * MB)] * 6
        options.update(path="/viewer/api/diagnostics", chunked=case == "viewer_chunked")
    elif case == "at_the_limit":
        chunks = at_the_limit(8_000_000)
    else:
        raise SystemExit(f"unknown case {case!r}")
    length = sum(map(len, chunks))
    with tempfile.TemporaryDirectory(prefix="bench-bodies-") as tmp:
        service = ServiceProcess(log=Path(tmp) / "service.log", log_level="info")
        try:
            before = vm_hwm(service.proc.pid)
            status, seconds = post(service.url, chunks, length, **options)
            growth = vm_hwm(service.proc.pid) - before
        finally:
            service.stop(60)
    return {
        "case": case,
        "body_mb": round(length / MB, 1),
        "status": status,
        "seconds": round(seconds, 2),
        "seconds_per_100_mb": round(seconds / (length / MB) * 100, 3),
        "rss_growth_mb": round(growth / MB, 1),
        "rss_growth_per_body_byte": round(growth / length, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="refused_by_tokens,refused_by_bytes,at_the_limit")
    args = parser.parse_args()
    for case in args.cases.split(","):
        print(json.dumps(run(case)), flush=True)


if __name__ == "__main__":
    main()
