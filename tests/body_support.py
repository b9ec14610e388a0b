"""What the tests of large bodies need: a service process's resident and peak memory (the peak
reset before a measurement), and a raw POST that sends its whole body, with Content-Length or
chunked, before it reads the answer (as most clients do)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

import pytest
from memory_support import status_bytes

MiB = 2**20


def rss(pid: int) -> int:
    """The process's resident set size now, bytes."""
    return status_bytes(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """The process's peak resident set size (VmHWM) since it started or was reset, bytes."""
    return status_bytes(pid, "VmHWM")


def reset_peak_rss(pid: int) -> int:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0); that RSS, bytes. A test
    then measures what one request adds to the peak, whatever start-up peaked at."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError as exc:  # pragma: no cover - depends on the kernel and permissions
        pytest.skip(f"cannot reset the peak RSS of process {pid}: {exc}")
    return rss(pid)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer from the socket: (status, headers in lower case, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk, f"the connection closed before an answer: {data[:200]!r}"
        data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    size = int(headers.get("content-length", "0"))
    while len(rest) < size:
        chunk = sock.recv(1 << 16)
        assert chunk, "the connection closed mid-answer"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:size]


def post_body(
    port: int,
    path: str,
    size: int,
    *,
    chunked: bool = False,
    fill: bytes = b" ",
    headers: Mapping[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """POST ``size`` bytes of ``fill`` (a multiple of 1 MiB) to 127.0.0.1:``port``, all sent
    before the answer is read, with Content-Length or (``chunked``) Transfer-Encoding: chunked.
    A reset while sending fails the test: a refused client must read its answer."""
    assert size % MiB == 0
    block = fill * MiB
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    extra = "".join(
        f"{k}: {v}\r\n" for k, v in {"Content-Type": "application/json", **(headers or {})}.items()
    )
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}{framing}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head)
        for _ in range(size // MiB):
            sock.sendall(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        return read_answer(sock)
