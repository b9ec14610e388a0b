"""A lone surrogate (or bytes that are not UTF-8) in any string of any transport, against a real
service: each is a 422 / INVALID_ARGUMENT naming the field, never a 500, INTERNAL or a reset;
the service's access log has a line for each; and an honest request afterwards is computed on
every transport.

Before, a JSON ``"\\ud800"`` in a request id was computed, then the answer could not be encoded
(a 500) and the access line that would have said so was lost to the logging error. Bodies and
messages are written byte by byte here: a client library would refuse to send what a client
may send.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import arrow_crafting as craft
import grpc
import numpy as np
import pyarrow as pa
import pytest
from advantage_client.grpc_client import compute_request_message, options_message
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_service.observability import logs
from advantage_service.observability.logs import JsonFormatter, TextFormatter
from process_support import poll
from support import Service, start_service

pytestmark = pytest.mark.integration

ARROW = "application/vnd.apache.arrow.stream"
METHOD = "/advantage.v1.AdvantageService/"
SURROGATE = b"\\ud800"  # as JSON escapes it
ENCODED = b"\xed\xa0\x80"  # a surrogate's bytes, as a protobuf or Arrow string would hold them
ROLLOUTS = (
    b'[{"tokens": [1, 2], "reward": 1.0, "teacher_logprobs": {"pos": [-0.1, -0.2]}},'
    b' {"tokens": [3], "reward": 0.0, "teacher_logprobs": {"pos": [-0.3]}}]'
)
HONEST = {
    "request_id": "honest-1",
    "namespace": "team-a",
    "estimator": "grpo",
    "groups": [
        {
            "id": "p",
            "rollouts": [{"tokens": [1, 2, 3], "reward": 1.0}, {"tokens": [2, 4], "reward": 0.0}],
        }
    ],
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    srv = start_service(tmp_path_factory.mktemp("text"))
    yield srv
    assert srv.proc.poll() is None, "the service died"
    assert "Traceback" not in srv.output(), srv.output()[-4000:]
    srv.stop()


# ---- what is sent -------------------------------------------------------------------------------


def json_body(place: str) -> bytes:
    """A JSON body with ``"\\ud800"`` in ``place``."""
    s = SURROGATE
    group = b'{"id": "g", "rollouts": %s}' % ROLLOUTS
    return {
        "request_id": b'{"request_id": "r-%s", "groups": [%s]}' % (s, group),
        "namespace": b'{"namespace": "%s", "groups": [%s]}' % (s, group),
        "preset": b'{"estimator": "grpo%s", "groups": [%s]}' % (s, group),
        "unknown key": b'{"%s": 1, "groups": [%s]}' % (s, group),
        "group id": b'{"groups": [%s, {"id": "g%s", "rollouts": %s}]}' % (group, s, ROLLOUTS),
        "teacher condition": b'{"groups": [%s]}' % group.replace(b'"pos"', b'"pos%s"' % s),
    }[place]


JSON_FIELDS = {
    "request_id": "request_id",
    "namespace": "namespace",
    "preset": "estimator",
    "unknown key": "\\ud800",
    "group id": "groups[1].id",
    "teacher condition": "groups[0].rollouts[0].teacher_logprobs.pos\\ud800",
}


def arrow_body(place: str) -> bytes:
    """An Arrow stream with a surrogate in ``place``: escaped in the request metadata's JSON,
    encoded in a column (written in place of as many bytes: the stream's lengths hold)."""
    options = {
        "request_id": b'{"request_id": "%s"}',
        "namespace": b'{"namespace": "%s"}',
        "preset": b'{"estimator": "%s"}',
        "unknown key": b'{"%s": 1}',
    }
    if place in options:
        metadata = (options[place] % SURROGATE).decode()
        table = craft.request_table().replace_schema_metadata({"advantage.request": metadata})
        return craft.stream(table)
    if place == "group id":
        table = craft.request_table(pa.array(["QQQ", "gb", "QQQ", "gb"]))
    else:  # teacher condition: the column teacher.<condition>
        table = craft.request_table(**{"teacher.QQQ": craft.request_table().column("logprobs")})
    body = craft.stream(table)
    assert b"QQQ" in body
    return body.replace(b"QQQ", ENCODED)


ARROW_ANSWERS = {  # place -> (code, field)
    "request_id": ("invalid_text", "request_id"),
    "namespace": ("invalid_text", "namespace"),
    "preset": ("invalid_text", "estimator"),
    "unknown key": ("invalid_text", "\\ud800"),
    # (a utf8 column holding bytes that are not UTF-8 is invalid Arrow, as it always was)
    "group id": ("invalid_arrow", "group_id"),
    "teacher condition": ("invalid_text", "columns[4]"),
}


def tensor(values: list[float], dtype: int) -> pb.Tensor:
    kind = "<f4" if dtype == pb.DTYPE_FLOAT32 else "<i4"
    return pb.Tensor(dtype=dtype, data=np.asarray(values, kind).tobytes())


def unary_message(place: str) -> bytes:
    """A ComputeRequest with a surrogate's bytes (or, in estimator_json, its escape)."""
    request: dict[str, Any] = json.loads(json.dumps(HONEST))
    for rollout in request["groups"][0]["rollouts"]:
        rollout["teacher_logprobs"] = {"pos": [-0.5] * len(rollout["tokens"])}
    where = {
        "request_id": "request_id",
        "namespace": "namespace",
        "preset": "estimator",
        "group id": "id",
        "teacher condition": "teacher",
    }
    if place == "unknown key":
        message = compute_request_message(request)
        message.options.estimator_json = '{"\\ud800": 1}'
        return message.SerializeToString()
    key = where[place]
    if key == "id":
        request["groups"][0]["id"] = "QQQ"
    elif key == "teacher":
        for rollout in request["groups"][0]["rollouts"]:
            rollout["teacher_logprobs"] = {"QQQ": rollout["teacher_logprobs"]["pos"]}
    else:
        request[key] = "QQQ"
    data = compute_request_message(request).SerializeToString()
    assert data.count(b"QQQ") == 1
    return data.replace(b"QQQ", ENCODED)


UNARY_FIELDS = {
    "request_id": "request_id",
    "namespace": "namespace",
    "preset": "estimator",
    "unknown key": "estimator.\\ud800",
    "group id": "group_ids[0]",
    "teacher condition": "teacher_logprobs",
}


def rollout_message(group_id: str = "g", teacher: str = "pos") -> pb.StreamRequest:
    return pb.StreamRequest(
        rollout=pb.Rollout(
            group_id=group_id,
            group_size=2,
            tokens=tensor([1, 2], pb.DTYPE_INT32),
            reward=1.0,
            teacher_logprobs={teacher: tensor([-0.1, -0.2], pb.DTYPE_FLOAT32)},
        )
    )


def stream_messages(place: str) -> list[bytes]:
    """A stream whose options or first rollout holds a surrogate."""
    options = pb.StreamRequest(options=options_message(estimator="grpo", namespace="team-a"))
    if place == "unknown key":
        bad = pb.StreamRequest(options=pb.ComputeOptions(estimator_json='{"\\ud800": 1}'))
        return [bad.SerializeToString(), rollout_message().SerializeToString()]
    if place in ("namespace", "preset"):
        fields = {"namespace": "QQQ"} if place == "namespace" else {"preset": "QQQ"}
        first = pb.StreamRequest(options=pb.ComputeOptions(**fields)).SerializeToString()
        return [first.replace(b"QQQ", ENCODED), rollout_message().SerializeToString()]
    rollout = rollout_message(
        **({"group_id": "QQQ"} if place == "group id" else {"teacher": "QQQ"})
    )
    data = rollout.SerializeToString()
    return [options.SerializeToString(), data.replace(b"QQQ", ENCODED)]


STREAM_FIELDS = {
    "namespace": "namespace",
    "preset": "estimator",
    "unknown key": "estimator.\\ud800",
    "group id": "group_id",
    "teacher condition": "teacher_logprobs",
}


# ---- sending ------------------------------------------------------------------------------------


def grpc_error(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, dict[str, Any]]:
    """(status, details, trailing metadata) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error: Any = caught.value
    metadata = {key: value for key, value in error.trailing_metadata() or ()}
    return error.code(), error.details(), metadata


def access_count(service: Service, transport: str, code: str) -> int:
    return sum(
        1
        for line in service.access_lines()
        if line["transport"] == transport and line["status"] == 422 and line["error"] == code
    )


def logged(service: Service, transport: str, code: str, before: int) -> None:
    """The refusal's access line is written (the service writes it as it answers)."""
    poll(
        lambda: access_count(service, transport, code) == before + 1,
        10,
        f"the access line of a {transport} {code} refusal",
    )


PLACES = ["request_id", "namespace", "preset", "unknown key", "group id", "teacher condition"]


@pytest.mark.parametrize("place", PLACES)
def test_http_json_answers_invalid_text_naming_the_field_and_logs_it(
    service: Service, place: str
) -> None:
    before = access_count(service, "http_json", "invalid_text")
    answer = service.http.post(
        "/v1/advantages", content=json_body(place), headers={"content-type": "application/json"}
    )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["field"]) == ("invalid_text", JSON_FIELDS[place]), error
    logged(service, "http_json", "invalid_text", before)


@pytest.mark.parametrize("place", PLACES)
def test_http_arrow_answers_422_naming_the_field_and_logs_it(service: Service, place: str) -> None:
    code, field = ARROW_ANSWERS[place]
    before = access_count(service, "http_arrow", code)
    answer = service.http.post(
        "/v1/advantages", content=arrow_body(place), headers={"content-type": ARROW}
    )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["field"]) == (code, field), error
    logged(service, "http_arrow", code, before)


def grpc_invalid_text(service: Service, place: str, stream: bool) -> tuple[str, str]:
    """The bad text at ``place`` sent to Compute (or StreamCompute) ends the call
    INVALID_ARGUMENT with the code invalid_text, and the refusal's access line is written;
    (the details, the field the error names)."""
    before = access_count(service, "grpc", "invalid_text")
    with service.channel() as channel:
        if stream:
            streaming = channel.stream_stream(
                METHOD + "StreamCompute", request_serializer=None, response_deserializer=None
            )
            status, details, metadata = grpc_error(
                lambda: list(streaming(iter(stream_messages(place)), timeout=30))
            )
        else:
            compute = channel.unary_unary(
                METHOD + "Compute", request_serializer=None, response_deserializer=None
            )
            status, details, metadata = grpc_error(
                lambda: compute(unary_message(place), timeout=30)
            )
    assert status == grpc.StatusCode.INVALID_ARGUMENT, details
    assert metadata["advantage-error-code"] == "invalid_text"
    logged(service, "grpc", "invalid_text", before)
    return details, metadata["advantage-field-bin"].decode()


@pytest.mark.parametrize("place", PLACES)
def test_grpc_compute_answers_invalid_argument_naming_the_field_and_logs_it(
    service: Service, place: str
) -> None:
    details, field = grpc_invalid_text(service, place, stream=False)
    assert field == UNARY_FIELDS[place]
    assert "UTF-8" in details


@pytest.mark.parametrize("place", [p for p in PLACES if p != "request_id"])
def test_grpc_stream_ends_invalid_argument_naming_the_field_and_logs_it(
    service: Service, place: str
) -> None:
    _, field = grpc_invalid_text(service, place, stream=True)
    assert field == STREAM_FIELDS[place]


@pytest.mark.parametrize(
    ("url", "transport", "field"),
    [
        ("/v1/stats/tokens?namespace=%ED%A0%80", "http_stats", "namespace"),
        ("/v1/stats/tokens?namespace=team-%FF&limit=5", "http_stats", "namespace"),
        ("/viewer/api/recent?namespace=%ED%A0%80", "http_viewer", "namespace"),
        ("/viewer/api/requests/r-%ED%A0%80?namespace=default", "http_viewer", "request_id"),
    ],
    ids=["stats", "stats-byte", "viewer-recent", "viewer-request"],
)
def test_query_and_path_parameters_that_are_not_utf8_are_invalid_text(
    service: Service, url: str, transport: str, field: str
) -> None:
    """The framework decodes them into U+FFFD (another namespace, silently): refused."""
    before = access_count(service, transport, "invalid_text")
    answer = service.http.get(url)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["field"]) == ("invalid_text", field), error
    logged(service, transport, "invalid_text", before)


def test_an_honest_request_afterwards_is_computed_on_every_transport(service: Service) -> None:
    """Runs after the refusals above (the same service)."""
    answer = service.http.post("/v1/advantages", json=HONEST)
    assert answer.status_code == 200, answer.text
    assert answer.json()["request_id"] == "honest-1"
    table = craft.request_table(options={"request_id": "honest-é", "estimator": "grpo"})
    answer = service.http.post(
        "/v1/advantages", content=craft.stream(table), headers={"content-type": ARROW}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["request_id"] == "honest-é"
    with service.channel() as channel:
        compute = channel.unary_unary(
            METHOD + "Compute",
            request_serializer=pb.ComputeRequest.SerializeToString,
            response_deserializer=pb.ComputeResponse.FromString,
        )
        response = compute(compute_request_message(HONEST), timeout=30)
        assert response.request_id == "honest-1"
        stream = channel.stream_stream(
            METHOD + "StreamCompute",
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.StreamResponse.FromString,
        )
        first = rollout_message("g-é")
        second = rollout_message("g-é")
        second.rollout.reward = 0.0
        answers = list(stream(iter([first, second]), timeout=30))
    assert [a.WhichOneof("kind") for a in answers] == ["result"]
    assert answers[0].result.group_id == "g-é"
    stats = service.http.get("/v1/stats/tokens", params={"namespace": "team-é"})
    assert stats.status_code == 200, stats.text
    assert service.http.get("/healthz").status_code == 200
    lines = service.access_lines()
    assert not [line for line in lines if line["status"] >= 500], lines


def test_nothing_the_refusals_held_reached_the_log_unescaped(service: Service) -> None:
    """Every line of the service's output is UTF-8 (a surrogate cannot be written as UTF-8:
    its line would have been lost, or written escaped)."""
    raw = Path(service.log).read_bytes()
    raw.decode("utf-8")
    assert b"Logging error" not in raw


# ---- the log formatters: a line is never lost to what it holds ---------------------------------


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_log_line_holding_a_lone_surrogate_is_written_escaped_not_lost(fmt: str) -> None:
    """Whatever a field or message holds (a lone surrogate, an integer JSON cannot hold), the
    line is written to a stream that encodes strictly, with the surrogate escaped."""
    sink = io.BytesIO()
    stream = io.TextIOWrapper(sink, encoding="utf-8", errors="strict", write_through=True)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.handleError = lambda record: pytest.fail("the log line was lost")  # type: ignore[method-assign]
    logger = logging.getLogger("advantage_service.tests.text")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("group %s", "g\ud800")
        level = logs.access_log.level
        logs.access_log.addHandler(handler)
        logs.access_log.setLevel(logging.INFO)  # (as the service configures it)
        try:
            logs.access(request_id="r\udcff", namespace="\ud83d", status=422, error="invalid_text")
        finally:
            logs.access_log.removeHandler(handler)
            logs.access_log.setLevel(level)
        extra = {"fields": {"id": "\udfff", "big": 2**70, "nested": {"\ud800": ["\ud800"]}}}
        logger.warning("fields", extra=extra)
    finally:
        logger.removeHandler(handler)
    lines = sink.getvalue().decode("utf-8").splitlines()
    assert len(lines) == 3, lines
    if fmt == "json":
        first, access, fields = (json.loads(line) for line in lines)
        assert first["message"] == "group g\\ud800"
        assert (access["request_id"], access["namespace"]) == ("r\\udcff", "\\ud83d")
        assert (access["status"], access["error"]) == (422, "invalid_text")
        assert fields["id"] == "\\udfff" and fields["big"] == str(2**70)
        assert fields["nested"] == {"\\ud800": ["\\ud800"]}
    else:
        assert lines[0].endswith("group g\\ud800")
        assert "request_id=r\\udcff namespace=\\ud83d" in lines[1]
