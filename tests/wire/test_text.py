"""Text is valid Unicode or refused, by every decoder: a lone surrogate (JSON's ``"\\ud800"``,
or the bytes of one) or bytes that are not UTF-8, in any string of a request, is a 422
``invalid_text`` naming the string's JSON path, and nothing an error or the answer carries
holds such a string (it could not be encoded: a 500, a lost log line).

The JSON bodies here are written byte by byte (``json.dumps`` would escape what it is given,
and the point is what a client may send)."""

from __future__ import annotations

import json
from typing import Any

import advantage_service as adv
import arrow_crafting as craft
import numpy as np
import orjson
import pyarrow as pa
import pytest
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_service.errors import RequestError
from advantage_service.transports import arrow
from advantage_service.transports.grpc_codec import (
    Malformed,
    decode_compute_message,
    lenient,
    write_tensor,
)
from advantage_service.transports.grpc_wire import MessageLimits
from advantage_service.wire.jsonio import BodyLimits, loads_request
from advantage_service.wire.request import parse_request
from advantage_service.wire.text import check_path_segment, check_query

LIMITS = BodyLimits(max_tokens=10_000, max_rollouts=1_000)
MESSAGE_LIMITS = MessageLimits(max_tokens=10_000, max_rollouts=1_000, max_group_size=64)
# What stands in for the bad text in a template, replaced by its bytes.
HOLE = b"HOLE"
# Bad text as JSON carries it: escapes (json accepts them) and raw bytes.
ESCAPES = {
    "lone high surrogate": b"\\ud800",
    "lone low surrogate": b"\\udfff",
    "high surrogate then a letter": b"\\ud83dx",
    "two high surrogates": b"\\ud800\\ud800",
}
RAW = {
    "byte 0xff": b"\xff",
    "encoded surrogate (CESU-8)": b"\xed\xa0\x80",
    "overlong NUL": b"\xc0\x80",
    "beyond U+10FFFF": b"\xf4\x90\x80\x80",
    "cut short": b"ok\xe2\x82",
}
BAD = {**ESCAPES, **RAW}
ROLLOUTS = (
    b'[{"tokens": [1, 2], "reward": 1.0, "teacher_logprobs": {"pos": [-0.1, -0.2]}},'
    b' {"tokens": [3], "reward": 0.0, "teacher_logprobs": {"pos": [-0.3]}}]'
)
GROUPS = b'[{"id": "g0", "rollouts": %s}, {"id": "g1", "rollouts": %s}]' % (ROLLOUTS, ROLLOUTS)
# Where the bad text goes (a template with HOLE in it) -> the field the refusal names.
PLACES: dict[str, tuple[bytes, str]] = {
    "request_id": (b'{"request_id": "HOLE", "groups": %s}' % GROUPS, "request_id"),
    "namespace": (b'{"namespace": "a-HOLE", "groups": %s}' % GROUPS, "namespace"),
    "preset": (b'{"estimator": "HOLE", "groups": %s}' % GROUPS, "estimator"),
    "outcome name": (
        b'{"estimator": {"outcome": {"name": "HOLE"}}, "groups": %s}' % GROUPS,
        "estimator.outcome.name",
    ),
    "estimator key": (b'{"estimator": {"HOLE": 1}, "groups": %s}' % GROUPS, "estimator.HOLE"),
    "return name": (b'{"return": ["scalar", "HOLE"], "groups": %s}' % GROUPS, "return[1]"),
    "unknown key": (b'{"HOLE": 1, "groups": %s}' % GROUPS, "HOLE"),
    "group id": (
        b'{"groups": [{"id": "g0", "rollouts": %s}, {"id": "HOLE", "rollouts": %s}]}'
        % (ROLLOUTS, ROLLOUTS),
        "groups[1].id",
    ),
    "prompt key": (
        b'{"groups": [{"id": "g0", "prompt_key": "HOLE", "rollouts": %s}]}' % ROLLOUTS,
        "groups[0].prompt_key",
    ),
    "unknown group key": (
        b'{"groups": [{"id": "g0", "HOLE": 1, "rollouts": %s}]}' % ROLLOUTS,
        "groups[0].HOLE",
    ),
    "unknown rollout key": (
        b'{"groups": [{"id": "g0", "rollouts": [{"tokens": [1], "reward": 1, "HOLE": 1},'
        b' {"tokens": [2], "reward": 0}]}]}',
        "groups[0].rollouts[0].HOLE",
    ),
    "teacher condition": (
        b'{"groups": [{"id": "g0", "rollouts": [{"tokens": [1], "reward": 1,'
        b' "teacher_logprobs": {"HOLE": [-0.1]}}, {"tokens": [2], "reward": 0,'
        b' "teacher_logprobs": {"HOLE": [-0.2]}}]}]}',
        "groups[0].rollouts[0].teacher_logprobs.HOLE",
    ),
}
REWARD_AS_TEXT = b'{"groups": [{"id": "g0", "rollouts": [{"tokens": [1], "reward": "HOLE"}]}]}'


def body_with(place: str, bad: bytes) -> bytes:
    template, _ = PLACES[place]
    return template.replace(HOLE, bad)


def shown_field(place: str, bad: bytes) -> str:
    """The field the refusal names: the path, a key in it as its escape where it is one."""
    field = PLACES[place][1]
    if b"HOLE" not in field.encode():
        return field
    # (a key is named by itself: decoded as the service decodes it, then escaped)
    key = json.loads(b'"' + bad + b'"') if bad in ESCAPES.values() else None
    if key is None:
        key = bad.decode("utf-8", "surrogateescape")
    return field.replace("HOLE", key.encode("utf-8", "backslashreplace").decode())


def refusal(body: bytes) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_request(loads_request(body, LIMITS))
    return caught.value


def assert_writable(error: RequestError) -> None:
    """The error's answer encodes (as the service writes it)."""
    orjson.dumps(error.to_dict())
    for text in (error.message, error.field or "", error.group_id or ""):
        text.encode("utf-8")


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
@pytest.mark.parametrize("place", list(PLACES))
def test_bad_text_in_any_string_of_a_json_body_is_invalid_text_naming_its_path(
    place: str, bad: bytes
) -> None:
    error = refusal(body_with(place, bad))
    assert (error.status, error.code, error.field) == (422, "invalid_text", shown_field(place, bad))
    assert error.field is not None and error.field.split(".")[0] in error.message
    assert_writable(error)


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_bad_text_where_a_number_belongs_is_refused_with_a_writable_error(bad: bytes) -> None:
    error = refusal(REWARD_AS_TEXT.replace(HOLE, bad))
    assert (error.status, error.code) == (422, "invalid_text")
    assert error.field == "groups[0].rollouts[0].reward"
    assert_writable(error)


def test_bad_text_between_the_strings_of_a_body_is_invalid_json() -> None:
    error = refusal(b'{"groups": []\xff}')
    assert (error.code, error.field) == ("invalid_json", None)


@pytest.mark.parametrize(
    "text",
    ["é", "😀", "\u2028", "\ufffd", "日本語"],
    ids=["two-byte", "astral", "line separator", "replacement character", "three-byte"],
)
@pytest.mark.parametrize("escaped", [False, True], ids=["raw", "escaped"])
def test_valid_unicode_anywhere_passes(text: str, escaped: bool) -> None:
    value = json.dumps(text, ensure_ascii=escaped).encode()[1:-1]
    req = parse_request(loads_request(body_with("group id", value), LIMITS))
    assert req.batch.group_ids == ["g0", text]
    req = parse_request(loads_request(body_with("request_id", value), LIMITS))
    assert req.request_id == text


# ---- the in-process API ----------------------------------------------------------------------


def in_process(**where: Any) -> dict[str, Any]:
    rollouts = [{"tokens": [1, 2], "reward": 1.0}, {"tokens": [3], "reward": 0.0}]
    request: dict[str, Any] = {"groups": [{"id": "g", "rollouts": rollouts}]}
    for path, value in where.items():
        if path == "group_id":
            request["groups"][0]["id"] = value
        elif path == "teacher":
            for r in rollouts:
                r["teacher_logprobs"] = {value: [-0.5] * len(r["tokens"])}
        else:
            request[path] = value
    return request


@pytest.mark.parametrize(
    ("where", "field"),
    [
        ({"request_id": "r\ud800"}, "request_id"),
        ({"namespace": "\udcff"}, "namespace"),
        ({"estimator": "grpo\udc80"}, "estimator"),
        ({"\ud800": 1}, "\\ud800"),
        ({"group_id": "g\ud800"}, "groups[0].id"),
        ({"teacher": "pos\ud800"}, "groups[0].rollouts[0].teacher_logprobs.pos\\ud800"),
    ],
    ids=["request_id", "namespace", "preset", "unknown key", "group id", "teacher condition"],
)
def test_the_in_process_api_refuses_a_str_holding_a_surrogate_naming_it(
    where: dict[str, Any], field: str
) -> None:
    with pytest.raises(RequestError) as caught:
        adv.compute(in_process(**where))
    error = caught.value
    assert (error.code, error.field) == ("invalid_text", field)
    assert_writable(error)


def test_an_error_never_carries_a_string_that_is_not_text() -> None:
    error = RequestError("x", "about \ud800", group_id="g\udcff", field="\ud83d")
    assert error.to_dict() == {
        "code": "x",
        "message": "about \\ud800",
        "group_id": "g\\udcff",
        "rollout_index": None,
        "field": "\\ud83d",
    }
    assert_writable(error)


# ---- Arrow --------------------------------------------------------------------------------------


def arrow_body(table: pa.Table, old: bytes, new: bytes) -> bytes:
    """``table`` as a stream with the bytes ``old`` (in its schema) replaced by ``new``."""
    body = craft.stream(table)
    assert old in body
    return body.replace(old, new)


def arrow_refusal(body: bytes) -> RequestError:
    with pytest.raises(RequestError) as caught:
        arrow.decode_request(body)
    assert_writable(caught.value)
    return caught.value


META = {"advantage.request": json.dumps(craft.OPTIONS)}


@pytest.mark.parametrize("bad", list(RAW.values()), ids=list(RAW))
def test_arrow_column_names_and_metadata_that_are_not_utf8_are_named(bad: bytes) -> None:
    values = craft.request_table().column("logprobs")
    hole = b"QQQQQ"  # (bytes found in the schema message only)
    table = craft.request_table(**{"teacher.QQQQQ": values})
    error = arrow_refusal(arrow_body(table, hole, bad.ljust(5, b"x")))
    assert (error.code, error.field) == ("invalid_text", "columns[4]")
    table = craft.request_table().replace_schema_metadata({**META, "QQQQQ": "v"})
    error = arrow_refusal(arrow_body(table, hole, bad.ljust(5, b"x")))
    assert (error.code, error.field) == ("invalid_text", "metadata")
    table = craft.request_table().replace_schema_metadata({**META, "k": "QQQQQ"})
    error = arrow_refusal(arrow_body(table, hole, bad.ljust(5, b"x")))
    assert (error.code, error.field) == ("invalid_text", "metadata.k")


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ('{"request_id": "HOLE"}', "request_id"),
        ('{"namespace": "HOLE"}', "namespace"),
        ('{"estimator": "HOLE"}', "estimator"),
        ('{"HOLE": 1}', "HOLE"),
    ],
    ids=["request_id", "namespace", "preset", "unknown key"],
)
def test_bad_text_in_the_arrow_request_metadata_is_named_by_its_json_path(
    options: str, field: str, bad: bytes
) -> None:
    if bad in ESCAPES.values():  # (ASCII: written as it is)
        options = options.replace("HOLE", bad.decode())
        body = craft.stream(
            craft.request_table().replace_schema_metadata({"advantage.request": options})
        )
    else:  # (bytes: in place of as many, the stream's lengths unchanged)
        table = craft.request_table().replace_schema_metadata({"advantage.request": options})
        body = arrow_body(table, HOLE, bad.ljust(len(HOLE), b"x"))
    error = arrow_refusal(body)
    assert error.code == "invalid_text"
    if field == "HOLE":  # (a key: named by itself, escaped)
        assert error.field is not None and "\\ud" in error.field
    else:
        assert error.field == field


@pytest.mark.parametrize("dictionary", [False, True], ids=["plain", "dictionary"])
def test_an_encoded_surrogate_in_an_arrow_group_id_is_invalid_arrow_naming_the_column(
    dictionary: bool,
) -> None:
    ids = pa.array(["QQQ", "gb", "QQQ", "gb"])
    table = craft.request_table(ids.dictionary_encode() if dictionary else ids)
    error = arrow_refusal(arrow_body(table, b"QQQ", b"\xed\xa0\x80"))
    assert (error.code, error.field) == ("invalid_arrow", "group_id")
    assert "utf8" in error.message.lower()


# ---- gRPC --------------------------------------------------------------------------------------


def compute_message(**fields: Any) -> pb.ComputeRequest:
    return pb.ComputeRequest(
        group_ids=fields.pop("group_ids", ["ga", "gb"]),
        group_index=write_tensor(np.array([0, 0, 1, 1])),
        offsets=write_tensor(np.array([0, 1, 2, 3, 4])),
        tokens=write_tensor(np.array([1, 2, 3, 4])),
        rewards=write_tensor(np.array([1, 0, 1, 0], np.float32)),
        **fields,
    )


TEACHER = write_tensor(np.full(4, -0.5, np.float32))
# A message with HOLE in one string field -> the field the refusal names.
GRPC_PLACES: dict[str, tuple[pb.ComputeRequest, str]] = {
    "request_id": (compute_message(request_id="HOLE"), "request_id"),
    "group id": (compute_message(group_ids=["ga", "HOLE"]), "group_ids[1]"),
    "namespace": (compute_message(options=pb.ComputeOptions(namespace="HOLE")), "namespace"),
    "preset": (compute_message(options=pb.ComputeOptions(preset="HOLE")), "estimator"),
    "return name": (
        compute_message(options=pb.ComputeOptions(returns=["scalar", "HOLE"])),
        "return[1]",
    ),
    "estimator_json": (
        compute_message(options=pb.ComputeOptions(estimator_json='{"outcome": "HOLE"}')),
        "estimator_json",
    ),
    "teacher condition": (
        compute_message(teacher_logprobs={"HOLE": TEACHER}),
        "teacher_logprobs",
    ),
    "prompt key": (compute_message(prompt_keys=["a", "HOLE"]), "prompt_keys[1]"),
}


@pytest.mark.parametrize("bad", list(RAW.values()), ids=list(RAW))
@pytest.mark.parametrize("place", list(GRPC_PLACES))
def test_a_grpc_string_field_that_is_not_utf8_is_invalid_text_naming_it(
    place: str, bad: bytes
) -> None:
    message, field = GRPC_PLACES[place]
    data = message.SerializeToString()
    assert data.count(HOLE) == 1
    data = data.replace(HOLE, bad.ljust(4, b"x"))
    with pytest.raises(RequestError) as caught:
        decode_compute_message(data, MESSAGE_LIMITS)
    assert (caught.value.code, caught.value.field) == ("invalid_text", field)
    assert_writable(caught.value)


@pytest.mark.parametrize(
    ("estimator_json", "field"),
    [
        ('{"outcome": {"name": "\\ud800"}}', "estimator.outcome.name"),
        ('{"\\udfff": 1}', "estimator.\\udfff"),
    ],
    ids=["value", "key"],
)
def test_a_surrogate_escape_in_grpc_estimator_json_is_named_as_over_http(
    estimator_json: str, field: str
) -> None:
    message = compute_message(options=pb.ComputeOptions(estimator_json=estimator_json))
    with pytest.raises(RequestError) as caught:
        decode_compute_message(message.SerializeToString(), MESSAGE_LIMITS)
    assert (caught.value.code, caught.value.field) == ("invalid_text", field)


STREAM_PLACES: dict[str, tuple[pb.StreamRequest, str]] = {
    "group id": (pb.StreamRequest(rollout=pb.Rollout(group_id="HOLE")), "group_id"),
    "rollout id": (
        pb.StreamRequest(rollout=pb.Rollout(group_id="g", rollout_id="HOLE")),
        "rollout_id",
    ),
    "prompt key": (
        pb.StreamRequest(rollout=pb.Rollout(group_id="g", prompt_key="HOLE")),
        "prompt_key",
    ),
    "teacher condition": (
        pb.StreamRequest(rollout=pb.Rollout(group_id="g", teacher_logprobs={"HOLE": pb.Tensor()})),
        "teacher_logprobs",
    ),
    "namespace": (pb.StreamRequest(options=pb.ComputeOptions(namespace="HOLE")), "namespace"),
    "preset": (pb.StreamRequest(options=pb.ComputeOptions(preset="HOLE")), "estimator"),
}


@pytest.mark.parametrize("place", list(STREAM_PLACES))
def test_a_stream_message_with_a_string_that_is_not_utf8_is_refused_naming_it(
    place: str,
) -> None:
    message, field = STREAM_PLACES[place]
    data = message.SerializeToString().replace(HOLE, b"\xed\xa0\x80x")
    parsed = lenient(pb.StreamRequest)(data)
    assert isinstance(parsed, Malformed)
    error = parsed.error()
    assert (error.code, error.field) == ("invalid_text", field)


def test_a_stream_message_that_does_not_parse_is_still_invalid_protobuf() -> None:
    parsed = lenient(pb.StreamRequest)(b"\x0a\x05ab")  # (a field cut short)
    assert isinstance(parsed, Malformed)
    assert (parsed.error().code, parsed.error().field) == ("invalid_protobuf", "message")


# ---- URLs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "field"),
    [
        (b"namespace=%ED%A0%80", "namespace"),
        (b"order=key&namespace=a%FF", "namespace"),
        (b"namespace=ok&limit=%C0%80", "limit"),
        (b"%FF=1", "query"),
    ],
)
def test_a_query_parameter_that_is_not_utf8_once_percent_decoded_is_named(
    query: bytes, field: str
) -> None:
    with pytest.raises(RequestError) as caught:
        check_query(query)
    assert (caught.value.code, caught.value.field) == ("invalid_text", field)


def test_query_strings_and_path_segments_of_utf8_pass() -> None:
    check_query(b"namespace=team-%C3%A9&order=key&limit=10")
    check_query(b"namespace=a+b&x")
    check_path_segment(b"/viewer/api/requests/r-%F0%9F%98%80", "request_id")
    with pytest.raises(RequestError) as caught:
        check_path_segment(b"/viewer/api/requests/r-%ED%A0%80", "request_id")
    assert (caught.value.code, caught.value.field) == ("invalid_text", "request_id")
