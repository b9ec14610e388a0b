"""Plain HTTP/1.1 for :class:`~advantage_client.HttpClient` on the standard library's
``http.client``: how the bytes move, under httpx's interface (its requests, responses, errors
and timeouts stay the client's).

Why: httpx's own transport reads an answer 64 KiB at a time through h11's event parser and
joins the pieces at the end (about 70 reads, as many parser events and several copies for the
4.4 MB Arrow answer of a training batch); ``http.client`` reads a body of known length with one
read into one buffer of its size. On that batch (bench/bench_http.py, 2026-12-07) an Arrow round
trip took 2-12 ms less through this transport than through httpx's, in the same runs.

Only ``http://`` without a proxy comes here (:func:`wanted`); TLS and proxies stay on httpx's
transport, whose certificate and proxy handling the client keeps unchanged. Errors are httpx's,
mapped as httpx's own transport maps them (connect: ConnectError/ConnectTimeout; sending:
WriteError/WriteTimeout; reading: ReadError/ReadTimeout; a server that closed the connection
or broke the protocol: RemoteProtocolError), so callers see one set of errors either way.
"""

from __future__ import annotations

import http.client
import select
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

# Idle connections kept per server: a trainer calls from one thread, a few at most.
MAX_IDLE = 8


def wanted(base_url: str) -> bool:
    """Whether ``base_url`` is one this transport carries: plain ``http://`` that the
    environment routes to no proxy (HTTP_PROXY, ALL_PROXY, NO_PROXY: httpx honours them, so a
    URL they send through a proxy keeps httpx's transport)."""
    url = httpx.URL(base_url)
    if url.scheme != "http":
        return False
    proxies = urllib.request.getproxies()
    if not (proxies.get("http") or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass(url.host))


def _stale(conn: http.client.HTTPConnection) -> bool:
    """An idle connection that has something to read has been closed by the server (an idle
    keep-alive connection receives nothing else): it must not carry the next request."""
    if conn.sock is None:
        return True
    try:
        if hasattr(select, "poll"):  # (select.select takes no descriptor above 1023)
            poller = select.poll()
            poller.register(conn.sock, select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


@contextmanager
def _mapped(
    request: httpx.Request, timeout: type[httpx.TimeoutException], error: type[httpx.RequestError]
) -> Iterator[None]:
    """The socket's and http.client's errors as httpx's."""
    try:
        yield
    except TimeoutError as exc:
        raise timeout(str(exc) or "timed out", request=request) from exc
    except http.client.RemoteDisconnected as exc:
        # Before OSError: RemoteDisconnected is a ConnectionResetError too.
        raise httpx.RemoteProtocolError(
            "Server disconnected without sending a response.", request=request
        ) from exc
    except http.client.HTTPException as exc:  # a short body, a malformed status line
        raise httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}", request=request) from exc
    except OSError as exc:
        raise error(str(exc), request=request) from exc


class Http11Transport(httpx.BaseTransport):
    """Blocking HTTP/1.1 over ``http.client`` with a pool of keep-alive connections per server,
    safe to share between threads (each request holds its own connection)."""

    def __init__(self, max_idle: int = MAX_IDLE) -> None:
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"this transport carries plain http://, not {url.scheme}://", request=request
            )
        key = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout", {})
        conn = self._checkout(key)
        if conn is None:
            conn = http.client.HTTPConnection(key[0], key[1], timeout=timeouts.get("connect"))
            with _mapped(request, httpx.ConnectTimeout, httpx.ConnectError):
                conn.connect()
        try:
            response, reusable = self._exchange(conn, request, timeouts)
        except BaseException:
            conn.close()
            raise
        if reusable:
            self._checkin(key, conn)
        else:
            conn.close()
        return response

    def _exchange(
        self, conn: http.client.HTTPConnection, request: httpx.Request, timeouts: dict
    ) -> tuple[httpx.Response, bool]:
        """The request sent and its answer read whole; whether the connection can carry
        another."""
        assert conn.sock is not None
        body = request.read()
        chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
        sent = True
        conn.sock.settimeout(timeouts.get("write"))
        try:
            with _mapped(request, httpx.WriteTimeout, httpx.WriteError):
                conn.putrequest(
                    request.method,
                    url=request.url.raw_path.decode("ascii"),
                    skip_host=True,  # httpx's headers have them
                    skip_accept_encoding=True,
                )
                for name, value in request.headers.raw:
                    conn.putheader(name, value)
                conn.endheaders(body, encode_chunked=chunked)
        except httpx.WriteError:
            # As httpx's transport does: a server may answer (a 413) and close before taking
            # the whole body; its answer, when there is one, is what the caller needs.
            sent = False
        conn.sock.settimeout(timeouts.get("read"))
        with _mapped(request, httpx.ReadTimeout, httpx.ReadError):
            raw = conn.getresponse()
            content = raw.read()  # with a length: one read into one buffer of that size
        response = httpx.Response(
            raw.status,
            headers=raw.getheaders(),
            stream=httpx.ByteStream(content),
            extensions={
                "http_version": b"HTTP/1.1" if raw.version == 11 else b"HTTP/1.0",
                "reason_phrase": raw.reason.encode("ascii", "replace"),
            },
        )
        return response, sent and not raw.will_close

    def _checkout(self, key: tuple[str, int]) -> http.client.HTTPConnection | None:
        while True:
            with self._lock:
                idle = self._idle.get(key)
                if not idle:
                    return None
                conn = idle.pop()
            if not _stale(conn):
                return conn
            conn.close()

    def _checkin(self, key: tuple[str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [conn for idle in self._idle.values() for conn in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()
