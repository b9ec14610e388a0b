"""Fuzzing every entry point of a real service with authentication on: schemathesis over the whole
OpenAPI document (positive and negative cases, and stateful sequences following the documented
links), and hypothesis-made protobuf payloads on every gRPC method (random bytes, corrupted
valid messages, random wire-format fields, and well-formed messages with random tensors). No
5xx, no INTERNAL or UNKNOWN, no hang, and the service stays healthy.

Schemathesis is driven through Hypothesis directly (its pytest plugin does not run under
pytest 9), as in tests/integration/test_http_fuzz.py. Every property is bounded (examples and
per-call timeouts) so the module stays around a minute.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import schemathesis
from advantage_client.grpc_client import compute_request_message, options_message
from advantage_contract.grpc_gen import advantage_pb2 as pb
from body_support import peak_rss
from fuzz_support import bounded
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from protobuf_bytes import varint
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support import Service, bearer, start_service, write_tokens

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "fuzz-token"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
SERVICE = "/advantage.v1.AdvantageService/"
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
CALL_TIMEOUT = 30
schemathesis.serializer.alias("application/vnd.apache.arrow.stream", "application/octet-stream")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    directory = tmp_path_factory.mktemp("fuzz")
    tokens = write_tokens(directory / "tokens.json", {TOKEN: ["default", "team-a"]})
    srv = start_service(
        directory,
        auth_tokens_file=tokens,
        max_request_tokens=20_000,
        max_group_size=32,
        max_body_bytes=1_000_000,
    )
    yield srv
    assert srv.proc.poll() is None, "the service died during fuzzing"
    srv.stop()


@pytest.fixture(scope="module")
def schema(service: Service) -> Any:
    return schemathesis.openapi.from_url(service.url + "/openapi.json")


def assert_healthy(service: Service) -> None:
    assert service.http.get("/healthz", timeout=10).status_code == 200
    assert service.grpc_health() == 1


# ---- HTTP: the whole OpenAPI document ---------------------------------------------------------


@pytest.mark.parametrize("token", [TOKEN, None, "wrong"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_route_never_answers_5xx_with_or_without_a_token(
    service: Service, schema: Any, mode: GenerationMode, token: str | None
) -> None:
    headers = bearer(token) if token else {}
    statuses: Counter[int] = Counter()

    @bounded(40)
    @given(case=schema.as_strategy(mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(headers=headers, timeout=CALL_TIMEOUT)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    run()
    assert sum(statuses.values()) >= 40, statuses
    if token is None or token == "wrong":
        assert 401 in statuses, statuses
    assert_healthy(service)


def test_stateful_sequences_following_the_documented_links_never_answer_5xx(
    service: Service, schema: Any
) -> None:
    base = schema.as_state_machine()
    calls: Counter[str] = Counter()

    class Machine(base):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"headers": bearer(TOKEN), "timeout": CALL_TIMEOUT}

        def validate_response(self, response: Any, case: schemathesis.Case, **kwargs: Any) -> None:
            calls[f"{case.method} {case.path} {response.status_code}"] += 1
            case.validate_response(response, checks=CHECKS)

    # (60 sequences: which of them reach a computed request, and follow its link, depends on
    # what the generator drew before in the process; 25 did not always)
    run_state_machine_as_test(Machine, settings=bounded(60, stateful_step_count=4))
    # The link was followed: statistics read after a computed request.
    assert calls["GET /v1/stats/tokens 200"] > 0, calls
    assert calls["POST /v1/advantages 200"] > 0, calls
    assert_healthy(service)


# ---- gRPC: protobuf payloads ------------------------------------------------------------------


@st.composite
def wire_fields(draw: st.DrawFn, depth: int = 0) -> bytes:
    """Random protobuf wire format: fields of any number and wire type, lengths that may lie,
    nested messages."""
    out = b""
    for _ in range(draw(st.integers(0, 6))):
        number = draw(st.integers(1, 40))
        wire = draw(st.sampled_from([0, 1, 2, 5, 3, 7]))
        out += varint(number << 3 | wire)
        if wire == 0:
            out += varint(draw(st.integers(0, 2**64 - 1)))
        elif wire == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wire == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        elif wire == 2:
            body = (
                draw(wire_fields(depth + 1))
                if depth < 2 and draw(st.booleans())
                else draw(st.binary(max_size=64))
            )
            length = len(body) + draw(st.sampled_from([0, 0, 0, -1, 1, 1000]))
            out += varint(max(length, 0)) + body
    return out


def tensor(draw: st.DrawFn) -> pb.Tensor:
    dtype = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 99]))
    data = draw(
        st.one_of(
            st.binary(max_size=64),
            st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12).map(
                lambda xs: struct.pack(f"<{len(xs)}i", *xs)
            ),
            st.lists(st.floats(width=32), max_size=12).map(
                lambda xs: struct.pack(f"<{len(xs)}f", *xs)
            ),
        )
    )
    return pb.Tensor(dtype=dtype, data=data)


@st.composite
def compute_messages(draw: st.DrawFn) -> bytes:
    """Well-formed ComputeRequests whose contents are random: tensors of any dtype and size,
    offsets and group indexes that need not agree, any options."""
    message = pb.ComputeRequest(
        request_id=draw(st.text(max_size=8)),
        options=options_message(
            namespace=draw(st.sampled_from(["", "default", "team-a", "team-b", "x" * 200])),
            estimator=draw(st.sampled_from([None, "grpo", "ktae", "nope", {"outcome": "rloo"}])),
            returns=draw(st.sampled_from([None, ["scalar"], ["bogus"]])),
        ),
        group_ids=draw(st.lists(st.sampled_from(["a", "b", ""]), max_size=4)),
    )
    for name in ("tokens", "offsets", "group_index", "rewards", "logprobs"):
        if draw(st.integers(0, 5)):
            getattr(message, name).CopyFrom(tensor(draw))
    return message.SerializeToString()


VALID = compute_request_message(
    {
        "namespace": "team-a",
        "estimator": "ktae",
        "groups": [
            {
                "id": "p",
                "rollouts": [
                    {"tokens": [1, 2, 3], "reward": 1.0, "logprobs": [-0.1, -0.2, -0.3]},
                    {"tokens": [2, 4], "reward": 0.0, "logprobs": [-0.5, -0.6]},
                ],
            }
        ],
    }
).SerializeToString()


@st.composite
def corrupted(draw: st.DrawFn, valid: bytes = VALID) -> bytes:
    """A valid message with bytes flipped, cut or inserted."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


# Strings that are not text: bytes that are not UTF-8 (an encoded surrogate among them) where
# protobuf holds a string, and, in the JSON of estimator_json, lone surrogate escapes.
NOT_UTF8 = st.sampled_from(
    [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xff", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"]
)
SURROGATE_ESCAPES = st.sampled_from([b"\\ud800", b"\\udfff", b"\\ud83dx"])
# (printable ASCII around it, quotes and backslashes aside: the JSON string stays one)
AROUND = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters='"\\'),
    max_size=4,
).map(str.encode)
# Where a ComputeRequest holds a string: wire bytes that set it (appended to a message, they
# replace a singular field's value, merge into options, add an element or a map entry).
UNARY_TEXT = {
    "request_id": lambda t: field_bytes(1, t),
    "namespace": lambda t: field_bytes(2, field_bytes(1, t)),
    "preset": lambda t: field_bytes(2, field_bytes(2, t)),
    "returns": lambda t: field_bytes(2, field_bytes(6, t)),
    "group_ids": lambda t: field_bytes(3, t),
    "teacher condition": lambda t: field_bytes(9, field_bytes(1, t) + field_bytes(2, b"")),
    "prompt_keys": lambda t: field_bytes(13, t),
}
# And a stream message: its options, or its rollout.
STREAM_TEXT = {
    "namespace": lambda t: field_bytes(1, field_bytes(1, t)),
    "preset": lambda t: field_bytes(1, field_bytes(2, t)),
    "group_id": lambda t: field_bytes(2, field_bytes(1, t)),
    "rollout_id": lambda t: field_bytes(2, field_bytes(3, t)),
    "teacher condition": lambda t: field_bytes(2, field_bytes(7, field_bytes(1, t))),
    "prompt_key": lambda t: field_bytes(2, field_bytes(11, t)),
}


@st.composite
def text_of(draw: st.DrawFn) -> bytes:
    return draw(AROUND) + draw(NOT_UTF8) + draw(AROUND)


@st.composite
def estimator_json_with_surrogates(draw: st.DrawFn) -> bytes:
    """options.estimator_json whose JSON holds a lone surrogate escape, as a value or a key."""
    bad = draw(AROUND) + draw(SURROGATE_ESCAPES) + draw(AROUND)
    template = draw(st.sampled_from([b'"%s"', b'{"outcome": "%s"}', b'{"%s": 1}']))
    return field_bytes(2, field_bytes(3, template % bad))


@st.composite
def bad_text_messages(draw: st.DrawFn) -> bytes:
    """A valid ComputeRequest with one of its strings not text."""
    if draw(st.booleans()):
        return VALID + draw(estimator_json_with_surrogates())
    return VALID + UNARY_TEXT[draw(st.sampled_from(sorted(UNARY_TEXT)))](draw(text_of()))


PAYLOADS = st.one_of(
    st.binary(max_size=256), wire_fields(), compute_messages(), corrupted(), bad_text_messages()
)
METADATA = (("authorization", f"Bearer {TOKEN}"),)


def assert_no_internal_error(call: Any, *args: Any) -> grpc.StatusCode:
    try:
        call(*args, metadata=METADATA, timeout=CALL_TIMEOUT)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        assert code not in BAD_CODES, (code, exc.details())  # type: ignore[attr-defined]
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the service hung"
        return code  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_grpc_unary_methods_answer_malformed_protobuf_without_internal_errors(
    service: Service,
) -> None:
    with grpc.insecure_channel(service.target) as channel:
        methods = [
            channel.unary_unary(SERVICE + name, request_serializer=None, response_deserializer=None)
            for name in ("Compute", "ListEstimators")
        ]

        codes: Counter[grpc.StatusCode] = Counter()

        @bounded(250)
        @given(payload=PAYLOADS, which=st.sampled_from([0, 0, 0, 1]))
        def run(payload: bytes, which: int) -> None:
            codes[assert_no_internal_error(methods[which], payload)] += 1

        run()
    assert sum(codes.values()) >= 250
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= set(codes), codes
    assert_healthy(service)


@st.composite
def stream_items(draw: st.DrawFn) -> bytes:
    """One stream message: options, a rollout with random contents, or garbage."""
    options = pb.StreamRequest(options=options_message(estimator="grpo", namespace="team-a"))
    rollout = pb.StreamRequest(
        rollout=pb.Rollout(
            group_id=draw(st.sampled_from(["g", "h", ""])),
            group_size=draw(st.integers(0, 3)),
            tokens=tensor(draw),
            reward=draw(st.floats(width=32)),
        )
    )
    bad_text = STREAM_TEXT[draw(st.sampled_from(sorted(STREAM_TEXT)))](draw(text_of()))
    return draw(
        st.one_of(
            st.just(options.SerializeToString()),
            st.just(rollout.SerializeToString()),
            corrupted(rollout.SerializeToString()),
            wire_fields(),
            st.binary(max_size=64),
            st.just(rollout.SerializeToString() + bad_text),
        )
    )


def test_grpc_streams_answer_malformed_protobuf_without_internal_errors(
    service: Service,
) -> None:
    with grpc.insecure_channel(service.target) as channel:
        stream = channel.stream_stream(
            SERVICE + "StreamCompute", request_serializer=None, response_deserializer=None
        )

        def call(payloads: list[bytes], **kwargs: Any) -> list[bytes]:
            return list(stream(iter(payloads), **kwargs))

        codes: Counter[grpc.StatusCode] = Counter()

        @bounded(120)
        @given(items=st.lists(stream_items(), max_size=6))
        def run(items: list[bytes]) -> None:
            codes[assert_no_internal_error(call, items)] += 1

        run()
    assert sum(codes.values()) >= 120
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= set(codes), codes
    assert_healthy(service)


def test_grpc_strings_that_are_not_text_are_invalid_text_never_internal(service: Service) -> None:
    """Bytes that are not UTF-8 in any string field of a Compute or stream message (any text
    around them), or lone surrogate escapes in estimator_json: INVALID_ARGUMENT
    ``invalid_text`` naming a field, never INTERNAL, UNKNOWN or a hang."""
    with grpc.insecure_channel(service.target) as channel:
        compute = channel.unary_unary(
            SERVICE + "Compute", request_serializer=None, response_deserializer=None
        )
        stream = channel.stream_stream(
            SERVICE + "StreamCompute", request_serializer=None, response_deserializer=None
        )
        options = pb.StreamRequest(options=options_message(estimator="grpo", namespace="team-a"))
        rollout = pb.StreamRequest(rollout=pb.Rollout(group_id="g", group_size=2))
        fields: Counter[str] = Counter()

        @bounded(150)
        @given(
            unary=bad_text_messages(),
            place=st.sampled_from(sorted(STREAM_TEXT)),
            text=text_of(),
            use_stream=st.booleans(),
        )
        def run(unary: bytes, place: str, text: bytes, use_stream: bool) -> None:
            def call() -> Any:
                if not use_stream:
                    return compute(unary, metadata=METADATA, timeout=CALL_TIMEOUT)
                bad = STREAM_TEXT[place](text)
                first = options.SerializeToString()
                if place in ("namespace", "preset"):
                    first += bad  # (merged into the options)
                    items = [first, rollout.SerializeToString()]
                else:
                    items = [first, rollout.SerializeToString() + bad]
                return list(stream(iter(items), metadata=METADATA, timeout=CALL_TIMEOUT))

            with pytest.raises(grpc.RpcError) as caught:
                call()
            error: Any = caught.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
            metadata = dict(error.trailing_metadata() or ())
            assert metadata.get("advantage-error-code") == "invalid_text", error.details()
            fields[metadata["advantage-field-bin"].decode().split(".")[0].split("[")[0]] += 1

        # Every place at least once, whatever the random draws reach (they vary with the tests
        # run before this one), then the random ones.
        for name in UNARY_TEXT:
            bad = VALID + UNARY_TEXT[name](b"\xff")
            run = example(unary=bad, place="namespace", text=b"", use_stream=False)(run)
        surrogate = VALID + field_bytes(2, field_bytes(3, b'"\\ud800"'))
        run = example(unary=surrogate, place="namespace", text=b"", use_stream=False)(run)
        for place in STREAM_TEXT:
            run = example(unary=VALID, place=place, text=b"\xff", use_stream=True)(run)
        run()
    assert {"request_id", "namespace", "estimator", "group_ids", "group_id"} <= set(fields), fields
    assert_healthy(service)


# The fuzzed service's peak RSS: its bodies are at most ADV_MAX_BODY_BYTES (1 MB here), so no
# input may take it far past what the service needs idle (~0.5 GB with torch) and one request.
PEAK_RSS_BOUND = 1536 * 2**20


def test_fuzzing_left_the_service_idle_and_within_its_memory_bound(service: Service) -> None:
    """Runs after the fuzzing above (same module-scoped service): nothing left in flight, no
    traceback, and the peak RSS over the whole fuzzing within a stated bound."""
    metrics = service.metrics()
    for gauge in ("advantage_inflight_requests", "advantage_stream_open"):
        assert metrics[(gauge, ())] == 0
    assert "Traceback" not in service.output()
    assert peak_rss(service.proc.pid) < PEAK_RSS_BOUND
