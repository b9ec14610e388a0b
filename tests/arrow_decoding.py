"""The Arrow request decoder in a subprocess, so that a crafted body that crashes it (SIGSEGV)
or hangs it fails a test instead of taking pytest down.

Run as a script it is the worker: it reads framed bodies (8-byte little-endian length, then
the bytes) from stdin, decodes each with ``advantage_service.transports.arrow.decode_request``
and writes one JSON line per body: ``{"ok": true, "group_ids", "rows", "tokens"}``, or the
request error (``status``, ``code``, ``field``, ``group_id``, ``rollout_index``, ``message``),
or ``{"unexpected": "..."}`` for any other exception (which the service would answer 500).

:class:`Decoder` is the test side: it starts the worker, sends a body, and raises
:class:`WorkerDied` (with the exit status: -11 is SIGSEGV) or :class:`WorkerHung` instead of
returning when the worker does not answer.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


class WorkerDied(AssertionError):
    pass


class WorkerHung(AssertionError):
    pass


class Decoder:
    """One decoding worker process, restarted after it dies."""

    def __init__(self, timeout: float = 20.0, startup: float = 120.0) -> None:
        self.timeout = timeout
        self.startup = startup
        self.proc: subprocess.Popen[bytes] | None = None
        self.pending = b""

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, str(HERE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.proc, self.pending = proc, b""
        if self._line(self.startup) != "ready":
            raise AssertionError("the decoding worker did not start")
        return proc

    def _line(self, timeout: float) -> str:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait(10)
                self.proc = None
                raise WorkerHung(f"the decoder did not answer within {timeout} s")
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    code = proc.wait(10)
                    self.proc = None
                    raise WorkerDied(f"the decoder died with exit status {code}")
                self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode()

    def decode(self, body: bytes) -> dict[str, Any]:
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(len(body).to_bytes(8, "little") + body)
            proc.stdin.flush()
        except BrokenPipeError:
            code = proc.wait(10)
            self.proc = None
            raise WorkerDied(f"the decoder died with exit status {code}") from None
        result: dict[str, Any] = json.loads(self._line(self.timeout))
        return result

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None


def _read_exactly(stream: Any, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def main() -> None:
    from advantage_service.errors import RequestError
    from advantage_service.transports import arrow

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"ready\n")
    stdout.flush()
    while len(head := _read_exactly(stdin, 8)) == 8:
        body = _read_exactly(stdin, int.from_bytes(head, "little"))
        result: dict[str, Any]
        try:
            req = arrow.decode_request(body)
            result = {
                "ok": True,
                "group_ids": req.batch.group_ids,
                "rows": req.batch.num_rollouts,
                "tokens": req.batch.num_tokens,
            }
        except RequestError as exc:
            result = {"ok": False, "status": exc.status, **exc.to_dict()}
        except Exception:  # the service would answer 500
            result = {"ok": False, "unexpected": traceback.format_exc()[-3000:]}
        stdout.write(json.dumps(result).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()
