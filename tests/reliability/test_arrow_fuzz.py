"""A structure-aware fuzzer of the Arrow request decoder.

Valid request streams written by pyarrow (plain and dictionary-encoded group ids, several
batches, replacement dictionaries, large and narrow types, null columns, an empty table) are
mutated where an attacker would: the int32/int64 words of their buffers (offsets, dictionary
indices, values), bytes of their data (invalid UTF-8), the lengths and null counts of their
field nodes, the offsets and lengths of their buffers, a batch's row count, a message's body
length and metadata length, and bytes of the flatbuffers themselves. Each body is decoded in a
worker subprocess (tests/arrow_decoding.py), so a crash fails the test with the body that
caused it, never pytest itself, and a hang is a timeout.

What must hold for every body: the worker answers (no crash, no hang); the answer is a decoded
request or a 413/422 request error, never another exception (a 500 in the service); a decoded
request's group ids are bytes of the body; and a secret decoded just before (so its bytes lie
in the worker's heap) never appears in an answer.

The short run is part of the default suite; the long run is behind the ``fuzz_long`` marker::

    FUZZ_EXAMPLES=200000 pytest -m fuzz_long tests/reliability/test_arrow_fuzz.py
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import arrow_crafting as craft
import pyarrow as pa
import pytest
from arrow_decoding import Decoder, WorkerDied, WorkerHung
from fuzz_support import bounded
from hypothesis import given
from hypothesis import strategies as st

SECRET = "s3cr3t-of-another-tenant-0123456789"
INTERESTING = [
    0, 1, -1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 63, 64, 255, 256, 4096, 2**15, 2**16,
    2**20, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**62, -(2**62), 2**63 - 1, -(2**63),
]  # fmt: skip
# Bodies that crashed or hung the decoder are kept here to reproduce (the falsifying example
# hypothesis prints names the seed and the mutations too).
FAILURES = Path(tempfile.gettempdir()) / "arrow-fuzz-failures"


def _seeds() -> list[bytes]:
    """Valid request streams of every layout the decoder reads."""
    table = craft.request_table()
    dictionary = pa.DictionaryArray.from_arrays(
        pa.array([0, 1, 0, 1], pa.int8()), pa.array(["ga", "gb"])
    )
    wide = craft.request_table(
        pa.array(["ga", "gb", "ga", "gb"], pa.large_string()),
        pa.array([1, 0, 0, 1], pa.int64()),
        **{
            "teacher.pos": pa.array(
                [[-1.0, -2.0], [-3.0], [-1.0, -1.0, -1.0], [-0.5]], pa.list_(pa.float16())
            ),
            "entropy": pa.array([None] * 4),
        },
    )
    wide = wide.set_column(
        2, "tokens", wide.column("tokens").cast(pa.large_list(pa.int64()))
    ).set_column(3, "logprobs", wide.column("logprobs").cast(pa.list_(pa.float64())))
    schema = pa.schema(
        [
            ("group_id", pa.dictionary(pa.int32(), pa.string())),
            ("reward", pa.float32()),
            ("tokens", pa.list_(pa.uint16())),
        ]
    )
    replaced = [
        pa.record_batch(
            [
                pa.DictionaryArray.from_arrays(pa.array(ix, pa.int32()), pa.array(words)),
                pa.array([1.0, 0.0], pa.float32()),
                pa.array([[1, 2], [3]], pa.list_(pa.uint16())),
            ],
            schema=schema,
        )
        for ix, words in (([0, 1], ["ga", "gb"]), ([1, 0], ["gc", "ga"]))
    ]
    several, _ = craft.several_batches(3)
    sliced, _ = craft.list_offsets_from(2)
    return [
        craft.stream(table),
        craft.stream(craft.request_table(dictionary)),
        craft.stream(wide),
        several,
        sliced,
        craft.stream(replaced[0], batches=replaced),
        craft.stream(table.slice(0, 0)),
        craft.stream(table, batches=[]),
    ]


SEEDS = _seeds()


@st.composite
def mutations(draw: st.DrawFn) -> tuple[Any, ...]:
    """One mutation: what to change, and raw choices resolved against the seed's layout."""
    value = draw(
        st.one_of(
            st.sampled_from(INTERESTING),
            st.integers(-(2**63), 2**63 - 1),
            st.integers(-16, 16).map(lambda d: ("delta", d)),
        )
    )
    kind = draw(
        st.sampled_from(
            ["word", "word", "word", "bytes", "node", "buffer", "rows", "body", "prefix", "flat"]
        )
    )
    return (
        kind,
        draw(st.integers(0, 2**16)),  # which message
        draw(st.integers(0, 2**16)),  # which buffer / node
        draw(st.integers(0, 2**16)),  # which word / byte / field
        draw(st.sampled_from([4, 8])),  # word width
        value,
        draw(st.binary(min_size=1, max_size=4)),
    )


def _resolve(value: Any, old: int) -> int:
    if isinstance(value, tuple):
        return old + value[1]
    return int(value)


def _put(data: bytearray, pos: int, width: int, value: Any) -> None:
    fmt = "<q" if width == 8 else "<i"
    if pos < 0 or pos + width > len(data):
        return
    old = struct.unpack_from(fmt, data, pos)[0]
    new = _resolve(value, old)
    lo, hi = (-(2**63), 2**63 - 1) if width == 8 else (-(2**31), 2**31 - 1)
    struct.pack_into(fmt, data, pos, min(max(new, lo), hi))


def _overwrite(data: bytearray, pos: int, raw: bytes) -> None:
    """``raw`` written at ``pos``, cut at the end (the body keeps its length)."""
    raw = raw[: max(0, len(data) - pos)]
    data[pos : pos + len(raw)] = raw


def mutate(body: bytes, changes: list[tuple[Any, ...]]) -> bytes:
    """``body`` with each change applied where the (current) layout puts it."""
    data = bytearray(body)
    for kind, m, b, w, width, value, raw in changes:
        try:
            found = craft.layout(bytes(data)).messages
        except ValueError:  # an earlier change broke the framing: flip bytes from here on
            _overwrite(data, w % len(data), raw)
            continue
        message = found[m % len(found)]
        batch = message.batch
        if kind == "prefix":
            _put(data, message.start + 4, 4, value)
        elif kind == "flat":
            span = max(1, message.metadata_end - message.metadata_start)
            _overwrite(data, message.metadata_start + w % span, raw)
        elif kind == "body" and message.body_length_at >= 0:
            _put(data, message.body_length_at, 8, value)
        elif batch is None:
            continue
        elif kind == "rows" and batch.length_at >= 0:
            _put(data, batch.length_at, 8, value)
        elif kind == "node" and batch.node_count:
            _put(data, batch.nodes_at + 16 * (b % batch.node_count) + 8 * (w % 2), 8, value)
        elif kind == "buffer" and batch.buffer_count:
            _put(data, batch.buffers_at + 16 * (b % batch.buffer_count) + 8 * (w % 2), 8, value)
        elif kind in ("word", "bytes") and batch.buffer_count:
            offset, length = batch.buffer(b % batch.buffer_count)
            if length <= 0:
                continue
            start = message.body_start + offset
            if kind == "word":
                words = max(1, length // width)
                _put(data, start + width * (w % words), width, value)
            else:
                _overwrite(data, start + w % length, raw)
    return bytes(data)


@pytest.fixture(scope="module")
def decoder() -> Iterator[Decoder]:
    worker = Decoder(timeout=30.0)
    # The secret's bytes pass through the worker's heap (pyarrow's and Python's) before any
    # fuzzed body: an answer that reads outside its body would find them there.
    planted = craft.stream(
        craft.request_table(pa.array([SECRET, SECRET + "-b", SECRET, SECRET + "-b"]))
    )
    for _ in range(20):
        assert worker.decode(planted)["ok"]
    yield worker
    worker.close()


def check_answer(body: bytes, answer: dict[str, Any]) -> None:
    assert "unexpected" not in answer, answer["unexpected"]
    text = json.dumps(answer)
    assert SECRET not in text, "an answer holds bytes from outside its body"
    if answer["ok"]:
        for group_id in answer["group_ids"]:
            assert group_id.encode() in body, f"group id {group_id[:80]!r} is not in the body"
    else:
        assert answer["status"] in (413, 422), answer
        assert answer["code"], answer


def run_fuzzer(decoder: Decoder, examples: int, derandomize: bool) -> Counter[str]:
    outcomes: Counter[str] = Counter()

    @bounded(examples, derandomize=derandomize)
    @given(seed=st.sampled_from(SEEDS), changes=st.lists(mutations(), min_size=1, max_size=4))
    def run(seed: bytes, changes: list[tuple[Any, ...]]) -> None:
        body = mutate(seed, changes)
        try:
            answer = decoder.decode(body)
        except (WorkerDied, WorkerHung) as exc:
            FAILURES.mkdir(exist_ok=True)
            kept = FAILURES / f"{hashlib.sha256(body).hexdigest()[:16]}.arrow"
            kept.write_bytes(body)
            raise type(exc)(f"{exc}; the body is kept in {kept}") from None
        check_answer(body, answer)
        outcomes["ok" if answer["ok"] else answer["code"]] += 1

    run()
    return outcomes


def test_the_seeds_decode(decoder: Decoder) -> None:
    """Every seed is a valid request: the mutations start from streams the decoder reads."""
    for seed in SEEDS:
        answer = decoder.decode(seed)
        assert answer["ok"], answer


def test_mutated_arrow_streams_never_crash_leak_or_fail_unexpectedly(decoder: Decoder) -> None:
    outcomes = run_fuzzer(decoder, examples=600, derandomize=True)
    # Not vacuous: mutations reach the column checks, not only the framing, and some survive.
    assert outcomes["invalid_arrow"] > 50, outcomes
    assert outcomes["ok"] > 5, outcomes
    assert sum(outcomes.values()) >= 600


@pytest.mark.fuzz_long
def test_mutated_arrow_streams_long_run(decoder: Decoder) -> None:
    examples = int(os.environ.get("FUZZ_EXAMPLES", "50000"))
    outcomes = run_fuzzer(decoder, examples=examples, derandomize=False)
    assert sum(outcomes.values()) >= examples
