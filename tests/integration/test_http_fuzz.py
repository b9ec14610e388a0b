"""Property-based fuzzing of the real server from its own /openapi.json (schemathesis): schema-
valid and schema-violating JSON bodies, Arrow bodies of random bytes, headers, every route. No
response may be a 5xx, and every response must match the documented statuses, content types and
schemas.

Cases come from schemathesis strategies driven by Hypothesis directly: schemathesis' pytest
plugin (``from_fixture``) does not run under pytest 9. Random bytes rarely make an Arrow stream,
so a second property sends well-formed streams of random columns, types, nulls and metadata.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest
import schemathesis
from advantage_service import presets
from fuzz_support import bounded
from http_support import ARROW, Server
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Schemathesis sends only media types it can serialise: Arrow bodies go out as raw bytes.
schemathesis.serializer.alias(ARROW, "application/octet-stream")
# Bounded so the whole fuzz run stays well under a minute on two cores.
EXAMPLES = {"POST /v1/advantages": 150, "every route": 60}


@pytest.fixture(scope="module")
def service_schema(server: Server) -> Any:
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def fuzz(strategy: Any, examples: int) -> None:
    @bounded(examples)
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=CHECKS, timeout=30)

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_advantages_never_answers_5xx_and_matches_its_spec(
    service_schema: Any, mode: GenerationMode
) -> None:
    operation = service_schema["/v1/advantages"]["POST"]
    fuzz(operation.as_strategy(mode), EXAMPLES["POST /v1/advantages"])


def test_every_route_never_answers_5xx_and_matches_its_spec(service_schema: Any) -> None:
    fuzz(service_schema.as_strategy(GenerationMode.POSITIVE), EXAMPLES["every route"])


# ---- Arrow tables that are well-formed streams with random columns, types and nulls ----------

INT_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.uint32(), pa.uint64()]
FLOAT_TYPES = [pa.float16(), pa.float32(), pa.float64()]
LIST_VALUES = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
)
OPTIONS = st.one_of(
    st.none(),
    st.just(b"{}"),
    st.just(b"not json"),
    st.just(b"[1, 2]"),
    st.sampled_from(sorted(presets())).map(lambda p: json.dumps({"estimator": p}).encode()),
    st.just(b'{"groups": []}'),
    st.just(b'{"return": ["scalar", "ktae_score"], "estimator": "ktae", "vocab_size": 100}'),
    # Text that is not text: lone surrogates escaped, bytes that are not UTF-8 (422, never 5xx).
    st.tuples(
        st.sampled_from(
            [b'{"request_id": "%s"}', b'{"namespace": "%s"}', b'{"estimator": "%s"}', b'{"%s": 1}']
        ),
        st.sampled_from([b"\\ud800", b"x\\udfff", b"\\ud83d\\ud83d", b"\xff", b"\xed\xa0\x80"]),
    ).map(lambda pair: pair[0] % pair[1]),
)


@st.composite
def list_column(draw: st.DrawFn, rows: int, value_types: list[pa.DataType]) -> pa.Array:
    kind = draw(st.sampled_from(value_types))
    values = draw(
        st.lists(
            st.one_of(st.none(), st.lists(LIST_VALUES, max_size=6)), min_size=rows, max_size=rows
        )
    )
    try:
        return pa.array(values, pa.list_(kind))
    except (pa.ArrowException, OverflowError, ValueError, TypeError):
        return pa.array([None] * rows, pa.list_(kind))


@st.composite
def valid_columns(draw: st.DrawFn) -> dict[str, pa.Array]:
    """A well-formed request table (any group order, any int/float widths)."""
    lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    rows = len(lengths)
    ids = draw(st.lists(st.sampled_from("abc"), min_size=rows, max_size=rows))
    tokens = [draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)) for n in lengths]
    columns = {
        "group_id": pa.array(ids, pa.string()),
        "reward": pa.array(
            draw(st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=rows, max_size=rows))
        ),
        "tokens": pa.array(tokens, pa.list_(draw(st.sampled_from(INT_TYPES[1:])))),
    }
    for name in draw(st.sets(st.sampled_from(["logprobs", "teacher.pos", "teacher.neg"]))):
        values = [draw(st.lists(st.floats(-20, 0), min_size=n, max_size=n)) for n in lengths]
        columns[name] = pa.array(values, pa.list_(draw(st.sampled_from(FLOAT_TYPES))))
    return columns


@st.composite
def chaotic_columns(draw: st.DrawFn) -> dict[str, pa.Array]:
    """Columns that may be missing, null, mistyped, out of range or mismatched."""
    rows = draw(st.integers(0, 6))
    columns: dict[str, pa.Array] = {}
    if draw(st.booleans()) or rows:
        ids = draw(
            st.lists(st.one_of(st.none(), st.sampled_from("abc")), min_size=rows, max_size=rows)
        )
        columns["group_id"] = pa.array(ids, draw(st.sampled_from([pa.string(), pa.large_string()])))
    if draw(st.integers(0, 9)):
        rewards = draw(
            st.lists(st.one_of(st.none(), st.floats(width=32)), min_size=rows, max_size=rows)
        )
        columns["reward"] = pa.array(rewards, draw(st.sampled_from(FLOAT_TYPES[1:])))
    if draw(st.integers(0, 9)):
        columns["tokens"] = draw(list_column(rows, [*INT_TYPES, pa.float32()]))
    for name in draw(st.sets(st.sampled_from(["logprobs", "teacher.pos", "teacher.neg", "x"]))):
        columns[name] = draw(list_column(rows, [*FLOAT_TYPES, pa.int32()]))
    return columns


@st.composite
def arrow_bodies(draw: st.DrawFn) -> bytes:
    columns = draw(st.one_of(valid_columns(), chaotic_columns()))
    table = pa.table(columns) if columns else pa.table({"reward": pa.array([], pa.float32())})
    options = draw(OPTIONS)
    if options is not None:
        table = table.replace_schema_metadata({"advantage.request": options})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def test_arrow_tables_never_answer_5xx(server: Server) -> None:
    answered: set[int] = set()

    @bounded(200)
    @given(body=arrow_bodies(), arrow_out=st.booleans())
    def run(body: bytes, arrow_out: bool) -> None:
        headers = {"content-type": ARROW}
        if arrow_out:
            headers["accept"] = ARROW
        response = server.client.post("/v1/advantages", content=body, headers=headers)
        assert response.status_code in (200, 413, 422), response.text
        if response.status_code != 200:
            assert set(response.json()["error"]) == {
                "code",
                "message",
                "group_id",
                "rollout_index",
                "field",
            }
        answered.add(response.status_code)

    run()
    # The generator reaches both outcomes, so the property is not vacuous.
    assert {200, 422} <= answered, answered


def test_corrupted_arrow_streams_never_answer_5xx_and_are_never_computed(server: Server) -> None:
    """Valid streams cut at any byte, with bytes flipped or with garbage appended: a 422 (or,
    for a flip the stream survives, what the stream then says), never a 5xx; a stream cut short
    or followed by other bytes is never computed as if it were whole."""
    answered: set[int] = set()

    @bounded(120)
    @given(
        body=arrow_bodies(),
        cut=st.floats(0.0, 0.999),
        flips=st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(1, 255)), max_size=3),
        tail=st.binary(min_size=1, max_size=16),
        kind=st.sampled_from(["cut", "flip", "append"]),
    )
    def run(
        body: bytes, cut: float, flips: list[tuple[float, int]], tail: bytes, kind: str
    ) -> None:
        if kind == "cut":
            mutated = body[: int(cut * len(body))]
        elif kind == "append":
            mutated = body + tail
        else:
            data = bytearray(body)
            for where, xor in flips:
                data[int(where * len(data))] ^= xor
            mutated = bytes(data)
        response = server.client.post(
            "/v1/advantages", content=mutated, headers={"content-type": ARROW}
        )
        assert response.status_code < 500, response.text
        if kind in ("cut", "append"):
            assert response.status_code in (413, 422), response.text
        answered.add(response.status_code)

    run()
    assert 422 in answered
    assert server.client.get("/healthz").status_code == 200


# ---- JSON bodies whose strings are not text --------------------------------------------------

# A JSON request, every string of it a place: the hole is where bad text goes.
HOLE = "HOLE-5a7c"
TEXT_PLACES: dict[str, dict[str, Any]] = {
    "request_id": {"request_id": HOLE},
    "namespace": {"namespace": HOLE},
    "preset": {"estimator": HOLE},
    "outcome name": {"estimator": {"outcome": {"name": HOLE}}},
    "estimator key": {"estimator": {"outcome": "grpo", HOLE: {}}},
    "return name": {"return": ["scalar", HOLE]},
    "unknown key": {HOLE: 1},
    "group id": {"group": {"id": HOLE}},
    "prompt key": {"group": {"prompt_key": HOLE}},
    "group key": {"group": {HOLE: 1}},
    "rollout key": {"rollout": {HOLE: 1}},
    "teacher condition": {"rollout": {"teacher_logprobs": {HOLE: [-0.5, -0.5]}}},
}
# Bad text as a client may send it: escapes json accepts, and raw bytes.
BAD_TEXT = st.sampled_from(
    [
        b"\\ud800",
        b"\\udc00",
        b"\\ud83dx",
        b"\\udfff\\ud800",
        b"\xff",
        b"\xed\xa0\x80",
        b"\xc0\x80",
        b"\xf4\x90\x80\x80",
        b"\xe2\x82",
    ]
)
# Text around it, as JSON writes it (escaped or not): the place stays a string of the request.
AROUND = st.text(
    st.characters(blacklist_categories=["Cs", "Cc"], blacklist_characters='"\\'), max_size=6
).map(lambda t: t.encode())


def text_body(place: str) -> bytes:
    change = TEXT_PLACES[place]
    rollouts = [{"tokens": [1, 2], "reward": 1.0}, {"tokens": [3, 4], "reward": 0.0}]
    group: dict[str, Any] = {"id": "g", "rollouts": rollouts}
    request: dict[str, Any] = {"groups": [group]}
    for key, value in change.items():
        if key == "group":
            group.update(value)
        elif key == "rollout":
            for rollout in rollouts:
                rollout.update(value)
        else:
            request[key] = value
    body = json.dumps(request, ensure_ascii=False).encode()
    assert body.count(HOLE.encode()) in (1, 2)
    return body


def test_json_strings_that_are_not_text_are_invalid_text_never_5xx(server: Server) -> None:
    """Any string of a JSON body (ids, names, keys, values) holding a lone surrogate or bytes
    that are not UTF-8, with any text around it: 422 ``invalid_text`` naming a field, never a
    5xx, and the server keeps answering."""
    fields: set[str] = set()

    @bounded(150)
    @given(
        place=st.sampled_from(sorted(TEXT_PLACES)),
        bad=BAD_TEXT,
        before=AROUND,
        after=AROUND,
    )
    def run(place: str, bad: bytes, before: bytes, after: bytes) -> None:
        body = text_body(place).replace(HOLE.encode(), before + bad + after)
        response = server.client.post(
            "/v1/advantages", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_text", error
        assert error["field"], error
        fields.add(error["field"].split(".")[0].split("[")[0])

    run()
    assert {"request_id", "namespace", "estimator", "return", "groups"} <= fields, fields
    assert server.client.get("/healthz").status_code == 200
