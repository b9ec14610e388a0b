"""Crafted Arrow request bodies, each attack reported against the Arrow codec as a test.

Decoder-level cases run in a worker subprocess (tests/arrow_decoding.py): a body that crashes
the decoder fails its test instead of ending pytest. The crash and the leak also run against a
real service, which must stay alive, answer 422, keep the connection, and send back no byte
from outside the body (a secret another tenant sent just before must not come back). The
memory cases measure the service's peak RSS (VmHWM, reset through /proc/<pid>/clear_refs
before each) around one crafted request: at most 2x the body's bytes + 16 MiB before the
refusal.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import arrow_crafting as craft
import httpx
import numpy as np
import pyarrow as pa
import pytest
from arrow_decoding import Decoder
from body_support import peak_rss
from support import Service, bearer, start_service, write_tokens

pytestmark = pytest.mark.integration

ARROW = "application/vnd.apache.arrow.stream"
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def decoder() -> Iterator[Decoder]:
    worker = Decoder()
    yield worker
    worker.close()


def refused(answer: dict[str, Any], status: int, code: str, field: str | None) -> dict[str, Any]:
    assert "unexpected" not in answer, answer
    assert not answer["ok"], answer
    assert (answer["status"], answer["code"], answer["field"]) == (status, code, field), answer
    return answer


# ---- 1, 2, 3: crashes, reads past the body, 500s ------------------------------------------------

OFFSETS = {
    "negative": craft.NEGATIVE_OFFSETS,
    "decreasing": craft.DECREASING_OFFSETS,
    "past-the-end": craft.OFFSETS_PAST_THE_END,
}


@pytest.mark.parametrize("offsets", list(OFFSETS.values()), ids=list(OFFSETS))
def test_group_id_offsets_that_crashed_the_decoder_are_422(
    decoder: Decoder, offsets: list[int]
) -> None:
    answer = refused(decoder.decode(craft.group_offsets(offsets)), 422, "invalid_arrow", "group_id")
    assert "offset" in answer["message"].lower()


@pytest.mark.parametrize("distance", [64, 1024, 8192])
def test_a_dictionary_entry_past_the_body_is_422(decoder: Decoder, distance: int) -> None:
    body = craft.dictionary_entry_past_the_end(distance)
    refused(decoder.decode(body), 422, "invalid_arrow", "group_id")


@pytest.mark.parametrize("dictionary", [False, True], ids=["plain", "dictionary"])
def test_invalid_utf8_in_a_group_id_is_422(decoder: Decoder, dictionary: bool) -> None:
    answer = decoder.decode(craft.invalid_utf8(dictionary))
    assert "utf" in refused(answer, 422, "invalid_arrow", "group_id")["message"].lower()


@pytest.mark.parametrize("index", [2, 1000, -1, -(2**31)])
def test_a_dictionary_index_out_of_range_is_422(decoder: Decoder, index: int) -> None:
    refused(decoder.decode(craft.dictionary_indices([0, index])), 422, "invalid_arrow", "group_id")


@pytest.mark.parametrize(
    ("value", "kind"),
    [(2**53 + 1, pa.int64()), (-(2**53) - 1, pa.int64()), (2**64 - 1, pa.uint64())],
    ids=["int64", "negative-int64", "uint64"],
)
def test_an_integer_reward_a_float64_cannot_hold_is_422_on_reward(
    decoder: Decoder, value: int, kind: pa.DataType
) -> None:
    answer = refused(
        decoder.decode(craft.integer_reward(value, kind)), 422, "out_of_range", "reward"
    )
    assert (answer["group_id"], answer["rollout_index"]) == ("gb", 0)
    assert str(value) in answer["message"]


def test_integer_rewards_up_to_2_53_are_computed(decoder: Decoder) -> None:
    assert decoder.decode(craft.integer_reward(2**53, pa.int64()))["ok"]
    assert decoder.decode(craft.integer_reward(2**53, pa.uint64()))["ok"]


# Buffers of the list columns in a record batch of request_table() (see arrow_crafting).
LIST_CASES = {
    "tokens decreasing": (craft.TOKENS_OFFSETS, [0, 3, 1, 6, 7], "tokens"),
    "tokens past the end": (craft.TOKENS_OFFSETS, [0, 2, 3, 6, 7 + 2**20], "tokens"),
    "logprobs negative": (craft.LOGPROBS_OFFSETS, [0, -8, 3, 6, 7], "logprobs"),
    "logprobs past the end": (craft.LOGPROBS_OFFSETS, [0, 2, 3, 6, 2**30], "logprobs"),
}


@pytest.mark.parametrize("case", list(LIST_CASES.values()), ids=list(LIST_CASES))
def test_list_offsets_are_validated_like_the_group_ids(
    decoder: Decoder, case: tuple[int, list[int], str]
) -> None:
    buffer, offsets, column = case
    body = craft.with_ints(craft.stream(craft.request_table()), 1, buffer, offsets)
    refused(decoder.decode(body), 422, "invalid_arrow", column)


def test_a_teacher_column_is_validated_and_named(decoder: Decoder) -> None:
    values = craft.request_table().column("logprobs")
    body = craft.stream(craft.request_table(**{"teacher.pos": values}))
    # teacher.pos follows logprobs: its offsets are buffer 14 of the record batch
    body = craft.with_ints(body, 1, craft.LOGPROBS_OFFSETS + 4, [0, 2, 1, 6, 7])
    refused(decoder.decode(body), 422, "invalid_arrow", "teacher.pos")


def test_a_list_child_longer_than_its_buffer_is_422(decoder: Decoder) -> None:
    """A node claiming more values than its buffer holds (the reader would read past it)."""
    body = bytearray(craft.stream(craft.request_table()))
    batch = craft.layout(body).messages[1].batch
    assert batch is not None
    tokens_values_node = 3
    pos = batch.nodes_at + 16 * tokens_values_node
    body[pos : pos + 8] = (2**20).to_bytes(8, "little")
    refused(decoder.decode(bytes(body)), 422, "invalid_arrow", "tokens")


def test_list_offsets_not_starting_at_0_are_computed_as_what_they_mean(decoder: Decoder) -> None:
    body, table = craft.list_offsets_from(2)
    answer = decoder.decode(body)
    assert answer["ok"], answer
    assert (answer["rows"], answer["tokens"]) == (4, 7)
    plain = decoder.decode(craft.stream(table))
    assert answer == plain


@pytest.mark.parametrize("dictionary", [False, True], ids=["plain", "dictionary"])
def test_an_empty_group_id_is_422_as_on_every_transport(decoder: Decoder, dictionary: bool) -> None:
    ids = pa.array(["ga", "", "ga", ""])
    table = craft.request_table(ids.dictionary_encode() if dictionary else ids)
    answer = refused(decoder.decode(craft.stream(table)), 422, "invalid_value", "group_id")
    assert "row 1" in answer["message"], answer


def test_several_record_batches_are_one_request(decoder: Decoder) -> None:
    body, table = craft.several_batches(3)
    assert len(craft.layout(body).messages) == 4
    assert decoder.decode(body) == decoder.decode(craft.stream(table))


# ---- 6: memory bounds declared in the metadata --------------------------------------------------


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_compressed_buffers_are_refused_before_decompression(decoder: Decoder, codec: str) -> None:
    body = craft.compressed_tokens(1_000_000, codec)
    assert len(body) < 100_000
    answer = refused(decoder.decode(body), 422, "invalid_arrow", None)
    assert "compress" in answer["message"]


def test_too_many_record_batches_are_413(decoder: Decoder) -> None:
    answer = refused(
        decoder.decode(craft.many_batches(1025)), 413, "limit_exceeded", "record_batches"
    )
    assert "1024" in answer["message"]
    assert decoder.decode(craft.many_batches(1023))["ok"]


def test_arrays_over_all_batches_are_bounded(decoder: Decoder) -> None:
    """300 batches of 64 teacher columns: 39,000 arrays, each some pyarrow objects."""
    values = craft.request_table().column("logprobs")
    wide = craft.request_table(**{f"teacher.t{i}": values for i in range(64)})
    answer = refused(
        decoder.decode(craft.many_batches(300, wide)), 413, "limit_exceeded", "record_batches"
    )
    assert "32768 arrays" in answer["message"]
    assert decoder.decode(craft.many_batches(200, wide))["ok"]


def test_schema_metadata_is_bounded_in_bytes_and_keys(decoder: Decoder) -> None:
    refused(decoder.decode(craft.big_metadata_value(2 * MIB)), 413, "limit_exceeded", "schema")
    refused(decoder.decode(craft.many_metadata_keys(100)), 413, "limit_exceeded", "metadata")
    assert decoder.decode(craft.big_metadata_value(512 * 1024))["ok"]
    assert decoder.decode(craft.many_metadata_keys(60))["ok"]


def test_rows_and_tokens_declared_over_the_limits_are_413_before_reading(decoder: Decoder) -> None:
    """A node declaring 2^40 token values or a batch of 2^40 rows, with no buffers to match:
    refused from the metadata (the worker runs on the default limits)."""
    body = bytearray(craft.stream(craft.request_table()))
    batch = craft.layout(body).messages[1].batch
    assert batch is not None
    tokens = bytearray(body)
    tokens[batch.nodes_at + 16 * 3 : batch.nodes_at + 16 * 3 + 8] = (2**40).to_bytes(8, "little")
    refused(decoder.decode(bytes(tokens)), 413, "limit_exceeded", "tokens")
    rows = bytearray(body)
    rows[batch.length_at : batch.length_at + 8] = (2**40).to_bytes(8, "little")
    refused(decoder.decode(bytes(rows)), 413, "limit_exceeded", "rollouts")


def test_delta_dictionaries_are_refused(decoder: Decoder) -> None:
    """pyarrow concatenates a delta onto the dictionary it has: never done with unchecked
    offsets (writers send whole dictionaries unless asked for deltas)."""
    ids = [
        pa.DictionaryArray.from_arrays(pa.array(ix, pa.int32()), pa.array(words))
        for ix, words in (([0, 1, 0, 1], ["ga", "gb"]), ([2, 0, 2, 0], ["ga", "gb", "gc"]))
    ]
    batches = [craft.request_table(i).to_batches()[0] for i in ids]
    body = craft.stream(batches[0], batches=batches, emit_dictionary_deltas=True)
    assert any(m.is_delta for m in craft.layout(body).messages)
    answer = refused(decoder.decode(body), 422, "invalid_arrow", "group_id")
    assert "delta" in answer["message"]
    whole = craft.stream(batches[0], batches=batches)
    assert decoder.decode(whole)["ok"]


def test_a_big_endian_stream_is_refused_before_pyarrow_swaps_it(decoder: Decoder) -> None:
    """pyarrow byte-swaps a big-endian stream's buffers as it reads them, offsets included,
    before anything is validated."""
    answer = refused(decoder.decode(craft.big_endian()), 422, "invalid_arrow", None)
    assert "big-endian" in answer["message"]


# ---- 8: ids and names at the JSON limits --------------------------------------------------------


@pytest.mark.parametrize("dictionary", [False, True], ids=["plain", "dictionary"])
def test_group_ids_over_256_characters_are_413_and_not_echoed(
    decoder: Decoder, dictionary: bool
) -> None:
    answer = refused(
        decoder.decode(craft.long_group_id(257, dictionary)), 413, "limit_exceeded", "group_id"
    )
    assert answer["group_id"] is None and "g" * 257 not in json.dumps(answer)
    assert "257" in answer["message"]
    huge = refused(decoder.decode(craft.long_group_id(MIB)), 413, "limit_exceeded", "group_id")
    assert len(json.dumps(huge)) < 1000
    assert decoder.decode(craft.long_group_id(256, dictionary))["ok"]


def test_teacher_condition_names_over_64_characters_are_413_and_not_echoed(
    decoder: Decoder,
) -> None:
    answer = refused(
        decoder.decode(craft.long_teacher_name(65)), 413, "limit_exceeded", "teacher_logprobs"
    )
    assert "t" * 65 not in json.dumps(answer)
    huge = refused(
        decoder.decode(craft.long_teacher_name(MIB // 2)), 413, "limit_exceeded", "teacher_logprobs"
    )
    assert len(json.dumps(huge)) < 1000
    assert decoder.decode(craft.long_teacher_name(64))["ok"]


def test_an_unknown_column_of_a_long_name_is_echoed_truncated(decoder: Decoder) -> None:
    values = craft.request_table().column("logprobs")
    body = craft.stream(craft.request_table(**{"x" * 100_000: values}))
    answer = refused(decoder.decode(body), 422, "unknown_field", "x" * 64)
    assert len(json.dumps(answer)) < 1000


# ---- through a real service ---------------------------------------------------------------------

SECRET = "team-b-secret-7f3a9c1e5b2d4086"
# The attacker's token may use the default namespace, where the crafted bodies go.
TOKENS = {"token-team-a": ["team-a", "default"], "token-team-b": ["team-b"]}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    directory = tmp_path_factory.mktemp("arrow-hardening")
    tokens = write_tokens(directory / "tokens.json", TOKENS)
    srv = start_service(directory, auth_tokens_file=tokens)
    yield srv
    srv.stop()


def post(client: httpx.Client, body: bytes, token: str = "token-team-a") -> httpx.Response:
    headers = {"content-type": ARROW, **bearer(token)}
    return client.post("/v1/advantages", content=body, headers=headers)


def with_namespace(body_table: pa.Table, namespace: str) -> bytes:
    options = {**craft.OPTIONS, "namespace": namespace}
    return craft.stream(
        body_table.replace_schema_metadata({"advantage.request": json.dumps(options)})
    )


def plant_secret(service: Service) -> None:
    """Team B's requests, its token and a secret in its ids and JSON body, just before."""
    table = craft.request_table(pa.array([SECRET, SECRET + "-2", SECRET, SECRET + "-2"]))
    for _ in range(10):
        answer = post(service.http, with_namespace(table, "team-b"), "token-team-b")
        assert answer.status_code == 200, answer.text
        answer = service.http.post(
            "/v1/advantages",
            json={
                "namespace": "team-b",
                "groups": [
                    {"id": SECRET, "rollouts": [{"tokens": [1], "reward": r} for r in (0, 1)]}
                ],
            },
            headers=bearer("token-team-b"),
        )
        assert answer.status_code == 200, answer.text


def assert_alive_and_kept_alive(
    service: Service, client: httpx.Client, answer: httpx.Response
) -> None:
    assert answer.headers.get("connection", "").lower() != "close", answer.headers
    assert service.proc.poll() is None, "the service died"
    again = post(client, craft.stream(craft.request_table()))
    assert again.status_code == 200, again.text


def test_the_crash_bodies_are_422_and_the_service_lives(service: Service) -> None:
    with httpx.Client(base_url=service.url, timeout=60.0) as client:
        for offsets in OFFSETS.values():
            answer = post(client, craft.group_offsets(offsets))
            assert answer.status_code == 422, answer.text
            error = answer.json()["error"]
            assert (error["code"], error["field"]) == ("invalid_arrow", "group_id")
            assert_alive_and_kept_alive(service, client, answer)
    assert service.http.get("/healthz").status_code == 200


def test_dictionary_entries_past_the_body_never_send_back_other_requests_bytes(
    service: Service,
) -> None:
    """The reported leak: team A's dictionary entry pointing past its body answered 200 with
    heap bytes (once team B's Authorization header and JSON body). Now: 422, and nothing of
    team B's in any answer."""
    plant_secret(service)
    forbidden = [SECRET.encode(), b"token-team-b"]
    with httpx.Client(base_url=service.url, timeout=60.0) as client:
        for distance in (64, 128, 512, 1024, 4096, 8192):
            answer = post(client, craft.dictionary_entry_past_the_end(distance))
            assert answer.status_code == 422, answer.text
            assert answer.json()["error"]["field"] == "group_id"
            assert not any(secret in answer.content for secret in forbidden), answer.content
        assert_alive_and_kept_alive(service, client, answer)


REFUSED_500S = {
    "utf8-plain": (lambda: craft.invalid_utf8(False), "invalid_arrow", "group_id"),
    "utf8-dictionary": (lambda: craft.invalid_utf8(True), "invalid_arrow", "group_id"),
    "index-out-of-range": (lambda: craft.dictionary_indices([0, 5]), "invalid_arrow", "group_id"),
    "index-negative": (lambda: craft.dictionary_indices([0, -3]), "invalid_arrow", "group_id"),
    "reward-int64": (
        lambda: craft.integer_reward(2**53 + 1, pa.int64()),
        "out_of_range",
        "reward",
    ),
    "reward-uint64": (
        lambda: craft.integer_reward(2**64 - 1, pa.uint64()),
        "out_of_range",
        "reward",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_500S.values()), ids=list(REFUSED_500S))
def test_what_answered_500_is_422_and_the_connection_stays(
    service: Service, case: tuple[Callable[[], bytes], str, str]
) -> None:
    make, code, field = case
    with httpx.Client(base_url=service.url, timeout=60.0) as client:
        answer = post(client, make())
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["field"]) == (code, field), error
        if field == "reward":
            assert (error["group_id"], error["rollout_index"]) == ("gb", 0)
        assert_alive_and_kept_alive(service, client, answer)


def json_twin(table: pa.Table) -> dict[str, Any]:
    """The JSON request of the same rollouts (group order by first appearance)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        groups.setdefault(row["group_id"], []).append(
            {"tokens": row["tokens"], "reward": row["reward"], "logprobs": row["logprobs"]}
        )
    return {
        **craft.OPTIONS,
        "groups": [{"id": gid, "rollouts": rollouts} for gid, rollouts in groups.items()],
    }


@pytest.mark.parametrize("layout", ["offsets-from-2", "three-batches"])
def test_valid_layouts_are_computed_as_their_json_twin(service: Service, layout: str) -> None:
    body, table = (
        craft.list_offsets_from(2) if layout == "offsets-from-2" else craft.several_batches(3)
    )
    answer = service.http.post(
        "/v1/advantages",
        content=body,
        headers={"content-type": ARROW, "accept": ARROW, **bearer("token-team-a")},
    )
    assert answer.status_code == 200, answer.text
    twin = service.http.post(
        "/v1/advantages", json=json_twin(table), headers=bearer("token-team-a")
    )
    assert twin.status_code == 200, twin.text
    want = {
        (group["id"], rank): rollout["advantages"]
        for group in twin.json()["groups"]
        for rank, rollout in enumerate(group["rollouts"])
    }
    with pa.ipc.open_stream(pa.py_buffer(answer.content)) as reader:
        rows = reader.read_all().to_pylist()
    assert len(rows) == len(want) == table.num_rows
    for row, expected in zip(rows, table.to_pylist(), strict=True):
        assert row["group_id"] == expected["group_id"]
        assert len(row["advantages"]) == len(expected["tokens"])
        np.testing.assert_allclose(
            row["advantages"], want[(row["group_id"], row["rollout_index"])], rtol=1e-6
        )


def test_ids_over_the_json_limits_are_413_over_http_without_the_id(service: Service) -> None:
    for body, field, name in (
        (craft.long_group_id(MIB), "group_id", b"g" * 257),
        (craft.long_teacher_name(1000), "teacher_logprobs", b"t" * 65),
    ):
        answer = post(service.http, body)
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["field"] == field
        assert name not in answer.content and len(answer.content) < 1000


def test_the_service_reads_its_batch_limit_from_adv_max_arrow_batches(
    service_factory: Callable[..., Service],
) -> None:
    limited = service_factory(max_arrow_batches=3)
    headers = {"content-type": ARROW}
    three, _ = craft.several_batches(3)
    assert limited.http.post("/v1/advantages", content=three, headers=headers).status_code == 200
    four, _ = craft.several_batches(4)
    answer = limited.http.post("/v1/advantages", content=four, headers=headers)
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["field"]) == ("limit_exceeded", "record_batches")
    assert "ADV_MAX_ARROW_BATCHES" in error["message"]


# ---- memory before the refusal: the service's peak RSS ------------------------------------------


def reset_peak(pid: int) -> int:
    """Reset the process's VmHWM to its current RSS (Linux: 5 > /proc/<pid>/clear_refs), so
    that the peak measured is the request's, not the start's."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return peak_rss(pid)


MEMORY_CASES: dict[str, tuple[Callable[[], bytes], int]] = {
    # (body, status): a few KB declaring 100 MB of token ids
    "zstd-25M-tokens": (lambda: craft.compressed_tokens(25_000_000, "zstd"), 422),
    "lz4-25M-tokens": (lambda: craft.compressed_tokens(25_000_000, "lz4"), 422),
    "50k-one-row-batches": (lambda: craft.many_batches(50_000), 413),
    "20MB-metadata-value": (lambda: craft.big_metadata_value(20 * MIB), 413),
    "500k-metadata-keys": (lambda: craft.many_metadata_keys(500_000), 413),
    "1MB-group-id": (lambda: craft.long_group_id(MIB), 413),
    "1MB-teacher-name": (lambda: craft.long_teacher_name(MIB), 413),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MEMORY_CASES.values()), ids=list(MEMORY_CASES))
def test_a_refused_body_costs_at_most_twice_its_bytes_plus_16_mib(
    service_factory: Callable[..., Service], case: tuple[Callable[[], bytes], int]
) -> None:
    """A fresh service per case (memory a process freed stays in its RSS and would hide the
    next case's growth), warmed up by one Arrow request."""
    make, status = case
    body = make()
    fresh = service_factory()
    warm = fresh.http.post(
        "/v1/advantages",
        content=craft.stream(craft.request_table()),
        headers={"content-type": ARROW},
    )
    assert warm.status_code == 200, warm.text
    pid = fresh.proc.pid
    before = reset_peak(pid)
    answer = fresh.http.post("/v1/advantages", content=body, headers={"content-type": ARROW})
    growth = peak_rss(pid) - before
    assert answer.status_code == status, answer.text[:500]
    assert growth <= 2 * len(body) + 16 * MIB, (
        f"peak RSS grew {growth / MIB:.1f} MiB for a body of {len(body) / MIB:.2f} MiB"
    )
