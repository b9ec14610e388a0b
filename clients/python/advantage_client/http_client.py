"""``HttpClient``: ``POST /v1/advantages`` with Arrow IPC on the wire (or JSON)."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import httpx
import numpy as np

from advantage_contract import arrow as contract_arrow
from advantage_contract.arrays import is_array, json_value, to_numpy
from advantage_contract.backend import RemoteBackend, check_contract
from advantage_contract.errors import AdvantageError
from advantage_contract.flat import nest_rows, split_rows
from advantage_contract.padded import (
    FlatRequest,
    PaddedResult,
    WireRequest,
    result_from_flat,
)

from . import http11
from .retry import Retryable, RetryPolicy, RetryStats

# A JSON request or answer for a training batch is megabytes of numbers: orjson, where
# installed (the service's environment has it), reads an answer in 0.6x of json's time (the
# same values: the service writes plain JSON numbers, never NaN or integers past 64 bits) and
# writes a request's arrays many times faster (json lists every array first).
orjson: Any
try:
    import orjson
except ImportError:  # pragma: no cover - (the client does not require it)
    orjson = None
_loads: Callable[[bytes], Any] = json.loads if orjson is None else orjson.loads


def dumps_request(request: Any) -> bytes:
    """``request`` as the JSON body ``json.dumps`` writes, arrays and tensors in it through
    :func:`json_value`. With orjson, each array of one or more dimensions is written whole
    (its float32 values in their shortest float32 form: the same float32 values read back; a
    per-token array is float32 on every wire), numbers and 0-d arrays as json writes them (a
    float32 parameter reads back as the same float64 as before, and so digests the same);
    unless the body holds a ``null``: orjson writes NaN and infinities as null where json
    writes ``NaN`` (which the service refuses naming the value), so a body with a null (a NaN,
    or a None given) is json's, as is anything orjson refuses (an integer past 64 bits, a key
    that is not a string)."""
    if orjson is not None and hasattr(orjson, "Fragment"):
        try:
            body: bytes = orjson.dumps(
                request,
                default=_orjson_default,
                option=orjson.OPT_PASSTHROUGH_SUBCLASS
                | orjson.OPT_PASSTHROUGH_DATACLASS
                | orjson.OPT_PASSTHROUGH_DATETIME,
            )
        except orjson.JSONEncodeError:
            pass
        else:
            if b"null" not in body:
                return body
    return json.dumps(request, default=_json_default).encode()


def _orjson_default(value: Any) -> Any:
    """orjson's ``default``: an array of one or more dimensions as its JSON text, written by
    orjson; anything else as :func:`_json_default` gives it."""
    if is_array(value):
        array = to_numpy(value)
        if array.ndim:
            return orjson.Fragment(
                orjson.dumps(np.ascontiguousarray(array), option=orjson.OPT_SERIALIZE_NUMPY)
            )
    return _json_default(value)


JSON = "application/json"
ARROW = contract_arrow.MEDIA_TYPE
REQUEST_METADATA = contract_arrow.REQUEST_METADATA
RESPONSE_METADATA = contract_arrow.RESPONSE_METADATA
# Answers worth another try: overloaded or not ready (503; overloaded with Retry-After and the
# body's retry_after_ms), saturated (429 with Retry-After, from services before 503), and a
# proxy in front that lost its replica (502: a replica killed mid-request, whose multi-megabyte
# body the proxy cannot send again; 504: it did not answer in the proxy's time), the statuses
# gRPC reads as UNAVAILABLE, which GrpcClient retries.
RETRY_STATUSES = (429, 502, 503, 504)


def _json_default(value: Any) -> Any:
    # (arrays and numbers of any framework: numpy, torch, JAX)
    return json_value(value)


def arrow_request_body(request: Mapping[str, Any]) -> bytes:
    """The JSON request as an Arrow IPC stream: one row per rollout, the options in the
    schema metadata (the contract's Arrow request)."""
    return arrow_body(WireRequest.from_json(request))


def arrow_flat_body(req: FlatRequest) -> bytes:
    """A padded call's flat arrays as an Arrow IPC request, one row per rollout in the
    trainer's row order (the service numbers groups by first appearance)."""
    return arrow_body(req.wire())


def arrow_body(wire: WireRequest) -> bytes:
    """A request's flat arrays as an Arrow IPC stream, the options in the schema metadata."""
    rows = wire.rows
    return contract_arrow.stream_bytes(
        contract_arrow.request_table(
            group_ids=rows.group_ids,
            group_index=rows.group_index,
            offsets=rows.offsets,
            tokens=wire.tokens,
            rewards=rows.rewards,
            per_token=wire.per_token,
            teacher_logprobs=wire.teacher_logprobs,
            prompt_keys=wire.prompt_keys,
            options_json=json.dumps(wire.options, default=_json_default),
            reward_components=wire.reward_components,
        )
    )


def arrow_flat_result(body: bytes, req: FlatRequest) -> PaddedResult:
    """An Arrow response (rows in request order) scattered back into the padded layout."""
    import pyarrow as pa

    with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
        table = reader.read_all()

    def flat(name: str) -> np.ndarray:
        column = table.column(name).combine_chunks()
        offsets = column.offsets.to_numpy(zero_copy_only=False)
        values = column.values.to_numpy(zero_copy_only=False)
        return np.asarray(values[offsets[0] : offsets[-1]], dtype=np.float32)

    scalars = table.column("scalar").to_numpy()
    names = [d for d in req.options["return"] if d != "scalar"]
    meta = json.loads((table.schema.metadata or {}).get(RESPONSE_METADATA, b"{}"))
    return result_from_flat(
        req.layout,
        flat("advantages"),
        scalars,
        {name: flat(name) for name in names},
        req.token_ids,
        meta.get("summary"),
    )


def arrow_response_dict(body: bytes) -> dict[str, Any]:
    """An Arrow response as the JSON response, with numpy float32 arrays for lists."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
        table = reader.read_all()
    meta = json.loads((table.schema.metadata or {})[RESPONSE_METADATA])
    encoded = pc.dictionary_encode(table.column("group_id").combine_chunks())
    group_ids = encoded.dictionary.to_pylist()
    group_index = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    columns: dict[str, list[Any]] = {}
    for name in table.column_names:
        if name in ("group_id", "rollout_index"):
            continue
        column = table.column(name).combine_chunks()
        if name == "scalar":
            columns[name] = column.to_pylist()
            continue
        offsets = column.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        values = column.values.to_numpy(zero_copy_only=False)
        values = values[offsets[0] : offsets[-1]]
        columns[name] = split_rows(values.astype(np.float32, copy=False), offsets - offsets[0])
    rows = [
        dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
    ]
    return {
        "request_id": meta["request_id"],
        "namespace": meta["namespace"],
        "estimator": meta["estimator"],
        "groups": nest_rows(group_ids, group_index, rows),
        "summary": meta["summary"],
    }


def json_response_dict(body: bytes) -> dict[str, Any]:
    """A JSON response with its per-token lists as numpy float32 arrays."""
    response: dict[str, Any] = _loads(body)
    for group in response["groups"]:
        for rollout in group["rollouts"]:
            for key, value in rollout.items():
                if isinstance(value, list):
                    rollout[key] = np.asarray(value, dtype=np.float32)
    return response


T = TypeVar("T")


def _answer(parse: Callable[[bytes], T], body: bytes, form: str) -> T:
    """``parse(body)`` of a 200 answer; an answer it cannot read (cut short, not the contract:
    a proxy's page, a service of another version) is an AdvantageError, not the parser's."""
    try:
        return parse(body)
    # (pyarrow's errors are these too: ArrowInvalid a ValueError, ArrowIOError an OSError, ...)
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        OSError,
        NotImplementedError,
    ) as exc:
        raise AdvantageError(
            "invalid_response",
            f"the answer ({len(body)} bytes) is not the service's {form} answer: "
            f"{type(exc).__name__}: {str(exc)[:200]}",
        ) from exc


def _retry_after_ms(value: Any) -> int | None:
    """The body's ``retry_after_ms`` when it is a whole number of milliseconds, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def error_from_response(response: httpx.Response) -> AdvantageError:
    """The service's ``{"error": {...}}`` (or whatever came back) as an AdvantageError, with
    its retry hints: ``Retry-After`` (seconds) and the body's ``retry_after_ms``."""
    retry_after = response.headers.get("retry-after", "").strip()
    try:
        detail = response.json()["error"]
        if not isinstance(detail, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        detail = {"code": f"http_{response.status_code}", "message": response.text[:500]}
    return AdvantageError(
        str(detail.get("code")),
        str(detail.get("message")),
        group_id=detail.get("group_id"),
        rollout_index=detail.get("rollout_index"),
        field=detail.get("field"),
        status=response.status_code,
        retry_after=float(retry_after) if retry_after.isdigit() else None,
        retry_after_ms=_retry_after_ms(detail.get("retry_after_ms")),
    )


def tls_context(
    ca_file: str | None = None, client_cert: str | None = None, client_key: str | None = None
) -> ssl.SSLContext:
    """A client TLS context: the service's CA (system CAs when None), and a client
    certificate for mutual TLS."""
    context = ssl.create_default_context(cafile=ca_file)
    if client_cert:
        context.load_cert_chain(client_cert, client_key)
    return context


class HttpClient(RemoteBackend):
    """A client of the HTTP API.

    ``wire="arrow"`` (default) sends and receives Arrow IPC: the flat arrays, no per-number
    text; ``"json"`` the JSON contract. ``timeout`` bounds each request (seconds). Retries
    connection failures (refused, closed or reset), 503 (overloaded, or not ready) and a
    proxy's 502 and 504 with exponential backoff; an overload refusal's wait is the body's
    ``retry_after_ms``, else ``Retry-After`` (see :class:`RetryPolicy`), never above
    ``max_backoff``. 429 (saturated, from services before 503) is retried the same way. It
    gives up after ``retries`` retries, or, by default (``retries=None``), once it has waited
    ``retry_for`` seconds (60) in all.

    ``token``: the bearer token (``Authorization: Bearer``). For an ``https://`` URL,
    ``ca_file`` is the CA that signed the service's certificate (system CAs when None), and
    ``client_cert``/``client_key`` the client's certificate for mutual TLS. ``transport``: an
    httpx transport to use; by default a plain ``http://`` URL without a proxy goes through
    :mod:`advantage_client.http11` (one read per answer), anything else through httpx's own.
    """

    client_name = "the HTTP client"

    def __init__(
        self,
        base_url: str,
        *,
        wire: Literal["arrow", "json"] = "arrow",
        timeout: float | None = 60.0,
        retries: int | None = None,
        backoff: float = 0.1,
        max_backoff: float = 10.0,
        retry_for: float = 60.0,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        if wire not in ("arrow", "json"):
            raise ValueError("wire must be 'arrow' or 'json'")
        self.wire = wire
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["authorization"] = f"Bearer {token}"
        verify: ssl.SSLContext | bool = True
        if ca_file or client_cert:
            verify = tls_context(ca_file, client_cert, client_key)
        if transport is None and http11.wanted(base_url):
            # Plain HTTP reads a multi-megabyte answer in one read (see http11).
            transport = http11.Http11Transport()
        self.http = httpx.Client(
            base_url=base_url,
            timeout=timeout,
            headers=all_headers,
            transport=transport,
            verify=verify,
        )
        self.retry = RetryPolicy(retries, backoff, max_backoff, retry_for)
        # Retries over this client's life (each also logged): a trainer's metric.
        self.retry_stats = RetryStats()

    def close(self) -> None:
        self.http.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        def attempt() -> httpx.Response:
            try:
                response = self.http.request(method, path, **kwargs)
            except (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                # A connection refused, closed or reset (ReadError, WriteError: a replica
                # killed, a listener closing, a keep-alive connection the server closed as the
                # request left) is the service unreachable for this try, whatever its TCP end.
                error = AdvantageError("unavailable", f"cannot reach the service: {exc}")
                raise Retryable(error) from None
            except httpx.TimeoutException as exc:
                raise AdvantageError("timeout", f"no answer in time: {exc}") from None
            if response.status_code == 200:
                return response
            error = error_from_response(response)
            if response.status_code in RETRY_STATUSES:
                raise Retryable(error, error.retry_after, error.retry_after_ms)
            raise error

        what = f"{method} {self.http.base_url.join(path)}"
        return self.retry.run(attempt, what=what, stats=self.retry_stats)

    def compute(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON request in (lists or numpy arrays inside), the JSON response out with numpy
        float32 arrays for the per-token lists. Raises :class:`AdvantageError`."""
        if self.wire == "arrow":
            body = self._post(arrow_request_body(request), ARROW)
            return _answer(arrow_response_dict, body, "Arrow")
        return _answer(json_response_dict, self._post(dumps_request(request), JSON), "JSON")

    def _compute_flat(self, req: FlatRequest) -> PaddedResult:
        """A padded call's flat arrays as Arrow columns, whatever ``wire`` says: the padded
        path has no per-rollout dicts to send as JSON."""
        body = self._post(arrow_flat_body(req), ARROW)
        return _answer(lambda answer: arrow_flat_result(answer, req), body, "Arrow")

    def _post(self, body: bytes, media_type: str) -> bytes:
        """``POST /v1/advantages`` of ``body``, answered in the same media type."""
        headers = {"content-type": media_type, "accept": media_type}
        return self._send("POST", "/v1/advantages", content=body, headers=headers).content

    def list_estimators(self) -> dict[str, Any]:
        """The service's ``GET /v1/estimators`` (a warning when its contract version differs
        from this client's)."""
        listing = _answer(json.loads, self._send("GET", "/v1/estimators").content, "JSON")
        if not isinstance(listing, dict):
            raise AdvantageError("invalid_response", "the estimator listing is not a JSON object")
        check_contract(listing, f"the service at {self.http.base_url}")
        return listing
