"""Named reward components (``reward_components``) on every wire, in-process: the same request
over JSON, Arrow, gRPC (unary and stream) and ``compute_padded`` decodes to the same batch,
whose values are the oracle's below (written from the contract: NaN for None, a missing reward
the weighted sum of the rollout's values, None left out); every bound is refused alike on each
wire naming the field; merged batches keep each request's components; digests of requests
without components are what they were."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from advantage_client.grpc_codec import (
    compute_request_message,
    flat_request_message,
    rollout_message,
    summary_dict,
)
from advantage_client.http_client import arrow_flat_body, arrow_request_body
from advantage_contract.arrow import request_table, stream_bytes
from advantage_contract.fields import (
    MAX_COMPONENT_NAME_LENGTH,
    MAX_REWARD_COMPONENTS,
    TOKEN_FIELDS,
)
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_service import compute_padded
from advantage_service.batch import RolloutBatch
from advantage_service.config import RequestLimits
from advantage_service.errors import RequestError
from advantage_service.serving.compute import compute
from advantage_service.serving.stream_groups import StreamGroup
from advantage_service.serving.term_state import request_digest
from advantage_service.transports.arrow import decode_request
from advantage_service.transports.grpc_codec import decode_compute_message, summary_message
from advantage_service.transports.grpc_stream import decode_rollout
from advantage_service.transports.guards import PRE_PARSERS
from advantage_service.wire.jsonio import BodyLimits, loads_request
from advantage_service.wire.request import ComputeRequest, parse_request
from client_support import padded_request

LIMITS = RequestLimits(max_tokens=1_000, max_rollouts=100, max_group_size=50)
NAN = math.nan

# Two groups; None: the rollout has no value of that component; no "reward": their sum.
ROLLOUTS = [
    ("g0", [1, 2, 3], None, {"format": 1.0, "accuracy": None}),
    ("g0", [4], 0.25, {"format": 0.0, "accuracy": 1.0}),
    ("g0", [5, 6], None, {"format": 0.5, "accuracy": 0.0}),
    ("g1", [7], None, {"format": None, "accuracy": 2.0}),
    ("g1", [8, 9], -1.0, {"format": 1.0, "accuracy": None}),
]


def oracle(weights: dict[str, float] | None = None) -> dict[str, Any]:
    """What the batch holds, from the contract's words alone (plain Python)."""
    weights = weights or {}
    rewards, derived = [], []
    for _, _, reward, values in ROLLOUTS:
        if reward is None:
            given = [weights.get(k, 1.0) * v for k, v in values.items() if v is not None]
            rewards.append(sum(given))
        else:
            rewards.append(reward)
        derived.append(reward is None)
    components = {
        name: [NAN if r[3][name] is None else r[3][name] for r in ROLLOUTS]
        for name in ("format", "accuracy")
    }
    return {"rewards": rewards, "derived": derived, "components": components}


def json_request(estimator: Any = "grpo", rollouts: Any = ROLLOUTS) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for gid, tokens, reward, values in rollouts:
        rollout: dict[str, Any] = {"tokens": tokens, "reward_components": dict(values)}
        if reward is not None:
            rollout["reward"] = reward
        groups.setdefault(gid, []).append(rollout)
    return {"estimator": estimator, "groups": [{"id": g, "rollouts": r} for g, r in groups.items()]}


def over_json(request: dict[str, Any]) -> ComputeRequest:
    body = json.dumps(request).encode()
    return parse_request(loads_request(body, BodyLimits(LIMITS.max_tokens, LIMITS.max_rollouts)))


def over_arrow(request: dict[str, Any]) -> ComputeRequest:
    return decode_request(arrow_request_body(request), LIMITS)


def over_grpc(request: dict[str, Any]) -> ComputeRequest:
    return decode_compute_message(compute_request_message(request).SerializeToString(), LIMITS)


WIRES = {"json": over_json, "arrow": over_arrow, "grpc": over_grpc}


def assert_batch(batch: RolloutBatch, expected: dict[str, Any]) -> None:
    np.testing.assert_allclose(batch.rewards.numpy(), expected["rewards"], rtol=1e-6)
    assert batch.reward_derived is not None
    assert batch.reward_derived.tolist() == expected["derived"]
    assert sorted(batch.reward_components) == sorted(expected["components"])
    for name, values in expected["components"].items():
        np.testing.assert_array_equal(batch.reward_components[name].numpy(), values)


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_every_wire_decodes_the_components_to_the_oracles_batch(wire: str) -> None:
    assert_batch(WIRES[wire](json_request()).batch, oracle())


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_a_missing_reward_is_the_sum_weighted_by_the_outcomes_weights(wire: str) -> None:
    weights = {"format": 0.5, "accuracy": 2.0}
    estimator = {"outcome": {"name": "gdpo", "weights": weights}}
    assert_batch(WIRES[wire](json_request(estimator)).batch, oracle(weights))


def test_the_stream_decodes_each_group_as_the_json_request_of_that_group() -> None:
    for gid in ("g0", "g1"):
        rows = [r for r in ROLLOUTS if r[0] == gid]
        group = StreamGroup(gid, len(rows))
        for i, (_, tokens, reward, values) in enumerate(rows):
            item: dict[str, Any] = {
                "group_id": gid,
                "group_size": len(rows),
                "tokens": tokens,
                "reward_components": values,
            }
            if reward is not None:
                item["reward"] = reward
            group.rollouts.append(decode_rollout(rollout_message(item), i))
        picked = [i for i, r in enumerate(ROLLOUTS) if r[0] == gid]
        full = oracle()
        expected = {
            "rewards": [full["rewards"][i] for i in picked],
            "derived": [full["derived"][i] for i in picked],
            "components": {k: [v[i] for i in picked] for k, v in full["components"].items()},
        }
        assert_batch(group.batch(None), expected)


def padded_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], dict[str, Any]]:
    width = max(len(r[1]) for r in ROLLOUTS)
    tokens = np.zeros((len(ROLLOUTS), width), dtype=np.int64)
    mask = np.zeros_like(tokens, dtype=bool)
    for i, (_, ids, _, _) in enumerate(ROLLOUTS):
        tokens[i, : len(ids)] = ids
        mask[i, : len(ids)] = True
    rewards = np.array([NAN if r[2] is None else r[2] for r in ROLLOUTS])
    components = {k: np.array(v) for k, v in oracle()["components"].items()}
    return tokens, mask, rewards, [r[0] for r in ROLLOUTS], components


@pytest.mark.parametrize("encode", ["arrow", "grpc"])
def test_the_clients_padded_call_sends_the_oracles_batch(encode: str) -> None:
    tokens, mask, rewards, gids, components = padded_arrays()
    req = padded_request(
        tokens, mask, rewards, gids, estimator="grpo", reward_components=components
    )
    if encode == "arrow":
        decoded = decode_request(arrow_flat_body(req), LIMITS)
    else:
        decoded = decode_compute_message(flat_request_message(req).SerializeToString(), LIMITS)
    assert_batch(decoded.batch, oracle())


@pytest.mark.parametrize("estimator", ["grpo", {"outcome": "grpo", "ktae": {}}])
def test_compute_padded_in_process_reads_the_derived_rewards(estimator: Any) -> None:
    # (grpo alone takes the outcome-only path, with ktae the gathered one)
    tokens, mask, rewards, gids, components = padded_arrays()
    got = compute_padded(
        tokens, mask, rewards, gids, estimator=estimator, reward_components=components
    )
    plain = compute_padded(tokens, mask, np.array(oracle()["rewards"]), gids, estimator=estimator)
    np.testing.assert_allclose(got.advantages, plain.advantages, rtol=1e-6, atol=1e-7)
    assert not np.allclose(plain.scalars, 0)


def test_compute_padded_takes_torch_tensors_and_names_a_bad_component() -> None:
    tokens, mask, rewards, gids, components = padded_arrays()
    got = compute_padded(
        torch.from_numpy(tokens),
        torch.from_numpy(mask),
        torch.from_numpy(rewards),
        gids,
        reward_components={k: torch.from_numpy(v) for k, v in components.items()},
    )
    expected = compute_padded(tokens, mask, np.array(oracle()["rewards"]), gids)
    np.testing.assert_allclose(got.scalars.numpy(), expected.scalars, rtol=1e-6)
    with pytest.raises(RequestError) as info:
        compute_padded(tokens, mask, rewards, gids, reward_components={"format": np.ones(2)})
    assert info.value.field == "reward_components.format"


# ---- bounds: every wire refuses alike, naming the field -------------------------------------

TOKENS = [[1, 2], [3], [4, 5]]


def raw_json(rewards: list[float | None], components: dict[str, list[float | None]]) -> bytes:
    rollouts = []
    for i, tokens in enumerate(TOKENS):
        rollout: dict[str, Any] = {
            "tokens": tokens,
            "reward_components": {k: v[i] for k, v in components.items()},
        }
        if rewards[i] is not None:
            rollout["reward"] = rewards[i]
        rollouts.append(rollout)
    return json.dumps({"groups": [{"id": "g", "rollouts": rollouts}]}).encode()


def raw_arrow(rewards: list[float | None], components: dict[str, list[float | None]]) -> bytes:
    as_nan = [NAN if r is None else r for r in rewards]
    table = request_table(
        group_ids=["g"],
        group_index=np.zeros(len(TOKENS), np.int64),
        offsets=np.cumsum([0, *map(len, TOKENS)]),
        tokens=np.concatenate(TOKENS).astype(np.int32),
        rewards=np.array(as_nan),
        per_token={},
        teacher_logprobs={},
        reward_components={
            k: np.array([NAN if x is None else x for x in v]) for k, v in components.items()
        },
    )
    return stream_bytes(table)


def raw_grpc(rewards: list[float | None], components: dict[str, list[float | None]]) -> bytes:
    def tensor(values: list[Any], dtype: str, wire: int) -> pb.Tensor:
        array = np.array([NAN if x is None else x for x in values], dtype=dtype)
        return pb.Tensor(dtype=wire, data=array.tobytes())

    message = pb.ComputeRequest(
        group_ids=["g"],
        group_index=tensor([0] * len(TOKENS), "<i8", pb.DTYPE_INT64),
        offsets=tensor(np.cumsum([0, *map(len, TOKENS)]).tolist(), "<i8", pb.DTYPE_INT64),
        tokens=tensor([t for ids in TOKENS for t in ids], "<i8", pb.DTYPE_INT64),
        rewards=tensor(rewards, "<f8", pb.DTYPE_FLOAT64),
    )
    for name, values in components.items():
        message.reward_components[name].CopyFrom(tensor(values, "<f8", pb.DTYPE_FLOAT64))
    return message.SerializeToString()


RAW = {"json": raw_json, "arrow": raw_arrow, "grpc": raw_grpc}
DECODERS = {
    "json": lambda body: parse_request(
        loads_request(body, BodyLimits(LIMITS.max_tokens, LIMITS.max_rollouts))
    ),
    "arrow": lambda body: decode_request(body, LIMITS),
    "grpc": lambda body: decode_compute_message(body, LIMITS),
}
LONG = "c" * (MAX_COMPONENT_NAME_LENGTH + 1)
# (rewards, components, the refusal every wire gives: status, code, field, group, rollout)
BOUNDS: dict[str, tuple[list[float | None], dict[str, list[Any]], tuple[Any, ...]]] = {
    "more components than the limit": (
        [1.0, 0.0, 1.0],
        {f"c{i}": [1.0, 1.0, 1.0] for i in range(MAX_REWARD_COMPONENTS + 1)},
        (413, "limit_exceeded", "reward_components"),
    ),
    "a component's name too long": (
        [1.0, 0.0, 1.0],
        {LONG: [1.0, 1.0, 1.0]},
        (413, "limit_exceeded", "reward_components"),
    ),
    "an infinite value": (
        [1.0, 0.0, 1.0],
        {"a": [1.0, math.inf, 1.0]},
        (422, "invalid_value", "reward_components.a", "g", 1),
    ),
    "neither a reward nor a component's value": (
        [1.0, None, 1.0],
        {"a": [1.0, None, 0.0], "b": [None, None, 1.0]},
        (422, "missing_input", "reward", "g", 1),
    ),
}


@pytest.mark.parametrize("wire", sorted(RAW))
@pytest.mark.parametrize("case", sorted(BOUNDS))
def test_every_wire_refuses_a_components_bound_naming_the_field(wire: str, case: str) -> None:
    rewards, components, expected = BOUNDS[case]
    with pytest.raises(RequestError) as info:
        DECODERS[wire](RAW[wire](rewards, components))
    exc = info.value
    got = (exc.status, exc.code, exc.field, exc.group_id, exc.rollout_index)
    assert got[: len(expected)] == expected, exc.message


@pytest.mark.parametrize("wire", sorted(RAW))
@pytest.mark.parametrize("case", ["more components than the limit", "a component's name too long"])
def test_the_pre_parsers_refuse_the_counted_bounds_before_decoding(wire: str, case: str) -> None:
    # (what the decoders refuse too: here from the bytes alone, nothing built)
    rewards, components, expected = BOUNDS[case]
    with pytest.raises(RequestError) as info:
        PRE_PARSERS[wire](RAW[wire](rewards, components), LIMITS)
    assert (info.value.status, info.value.code, info.value.field) == expected


def test_within_the_bounds_every_wire_takes_the_same_request() -> None:
    components = {
        f"c{i}": [1.0, 0.25 if i == 0 else None, 0.5] for i in range(MAX_REWARD_COMPONENTS)
    }
    rewards: list[float | None] = [1.0, None, None]
    for wire in sorted(RAW):
        batch = DECODERS[wire](RAW[wire](rewards, components)).batch
        np.testing.assert_allclose(batch.rewards.numpy(), [1.0, 0.25, 8.0])


def test_a_rollout_that_leaves_out_a_name_the_others_give_is_refused_by_name() -> None:
    request = json_request()
    del request["groups"][1]["rollouts"][0]["reward_components"]["format"]
    with pytest.raises(RequestError) as info:
        over_json(request)
    exc = info.value
    assert (exc.code, exc.field, exc.group_id, exc.rollout_index) == (
        "missing_input",
        "reward_components.format",
        "g1",
        0,
    )


def test_a_request_without_components_needs_its_rewards_as_before() -> None:
    request = json_request()
    for group in request["groups"]:
        for rollout in group["rollouts"]:
            del rollout["reward_components"]
    with pytest.raises(RequestError) as info:
        over_json(request)
    assert (info.value.field, info.value.group_id, info.value.rollout_index) == ("reward", "g0", 0)


# ---- merged batches, summaries, digests ------------------------------------------------------


def test_a_merged_batch_holds_the_union_of_names_none_where_a_request_lacks_one() -> None:
    first = RolloutBatch.from_flat(
        [1, 2, 3], [0, 1, 3], ["a"], [0, 0], [NAN, 1.0], reward_components={"x": [2.0, 0.0]}
    )
    second = RolloutBatch.from_flat([4], [0, 1], ["a"], [0], [0.5], reward_components={"y": [3.0]})
    third = RolloutBatch.from_flat([5], [0, 1], ["b"], [0], [1.5])
    merged = RolloutBatch.concat([first, second, third])
    np.testing.assert_array_equal(merged.reward_components["x"].numpy(), [2.0, 0.0, NAN, NAN])
    np.testing.assert_array_equal(merged.reward_components["y"].numpy(), [NAN, NAN, 3.0, NAN])
    assert merged.reward_derived is not None
    assert merged.reward_derived.tolist() == [True, False, False, False]
    np.testing.assert_array_equal(merged.rewards.numpy(), [2.0, 1.0, 0.5, 1.5])
    moved = merged.to("meta")
    assert sorted(moved.reward_components) == ["x", "y"]
    assert moved.reward_components["x"].device.type == "meta"


def test_the_summary_gives_each_components_mean_and_std_without_the_missing_values() -> None:
    response = compute(json_request(), device="cpu")
    stats = response["summary"]["reward_components"]
    for name, values in oracle()["components"].items():
        present = np.array([v for v in values if not math.isnan(v)])
        assert stats[name]["mean"] == pytest.approx(present.mean())
        assert stats[name]["std"] == pytest.approx(present.std(ddof=1))
    # The gRPC summary carries the same (None: NaN on the wire, None again in the client).
    stats["lonely"] = {"mean": 1.0, "std": None}
    back = summary_dict(summary_message(response["summary"]))["reward_components"]
    assert back["lonely"] == {"mean": 1.0, "std": None}
    for name in ("format", "accuracy"):
        assert back[name] == pytest.approx(stats[name])


def old_digest(req: ComputeRequest) -> str:
    """The stored digest as earlier releases computed it (the fields they hashed, in order)."""
    h = xxhash.xxh3_128()

    def put(name: str, data: bytes) -> None:
        h.update(b"%s %d\n" % (name.encode(), len(data)))
        h.update(data)

    def text(values: list[str]) -> bytes:
        joined = "".join(values).encode("utf-8", "surrogatepass")
        return np.asarray([len(v) for v in values], np.int64).tobytes() + joined

    put("namespace", req.namespace.encode())
    put("estimator", json.dumps(req.estimator.to_dict(), sort_keys=True, default=repr).encode())
    put("ignore_token_ids", np.asarray(sorted(set(req.ignore_token_ids)), np.int64).tobytes())
    put("vocab_size", b"%d" % (-1 if req.vocab_size is None else req.vocab_size))
    batch = req.batch
    names = ["tokens", "offsets", "group_index", "rewards", *TOKEN_FIELDS]
    tensors = [(n, getattr(batch, n)) for n in names]
    tensors += [(f"teacher:{n}", batch.teacher_logprobs[n]) for n in sorted(batch.teacher_logprobs)]
    for name, tensor in tensors:
        if tensor is not None:
            array = np.ascontiguousarray(tensor.cpu().numpy())
            put(f"{name} {array.dtype.str} {array.shape}", array.reshape(-1).tobytes())
    put("group_ids", text(batch.group_ids))
    put("prompt_ids", text(batch.prompt_ids or []))
    return h.hexdigest()


def test_a_request_without_components_keeps_its_digest_and_components_change_it() -> None:
    plain = {
        "estimator": "grpo",
        "groups": [
            {
                "id": "g",
                "rollouts": [
                    {"tokens": [1, 2], "reward": 1.0, "teacher_logprobs": {"pos": [-1.0, -2.0]}},
                    {"tokens": [3], "reward": 0.0, "teacher_logprobs": {"pos": [-0.5]}},
                ],
            }
        ],
    }
    req = over_json(plain)
    assert request_digest(req) == old_digest(req)
    for rollout, value in zip(plain["groups"][0]["rollouts"], (1.0, 0.0), strict=True):
        rollout["reward_components"] = {"format": value}
    with_components = over_json(plain)
    assert old_digest(with_components) == old_digest(req)  # (same rewards: only they differ)
    assert request_digest(with_components) != request_digest(req)
