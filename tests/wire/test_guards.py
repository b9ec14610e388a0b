"""The pre-parsers of every wire format, through their one interface (transports/guards.py),
answer a request over a bound alike: the same request written as JSON, as an Arrow stream and
as a gRPC message is refused with the same status naming the same field, whichever carries it,
or passes on all three."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from advantage_contract.arrow import request_table, stream_bytes
from advantage_contract.fields import MAX_CONDITION_NAME_LENGTH, MAX_TEACHER_CONDITIONS
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_service.errors import RequestError
from advantage_service.transports.guards import PRE_PARSERS, PreParser, RequestLimits
from advantage_service.wire.request import (
    MAX_IGNORE_TOKEN_IDS,
    MAX_NAME_LENGTH,
    MAX_NAMESPACE_LENGTH,
    MAX_REQUEST_ID_LENGTH,
    MAX_RETURN_NAMES,
)


@dataclass(frozen=True)
class Request:
    """A request as every wire carries it: groups of rollouts of tokens, teacher conditions,
    options."""

    rollouts: tuple[int, ...] = (2, 2)  # per group
    tokens: int = 3  # per rollout
    conditions: tuple[str, ...] = ("pos",)
    request_id: str = "r-1"
    namespace: str = "guards"
    preset: str = "grpo"
    returns: tuple[str, ...] = ("scalar",)
    ignore: tuple[int, ...] = (0,)

    def group_index(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.rollouts)), self.rollouts)

    def token_ids(self) -> np.ndarray:
        return np.arange(len(self.group_index()) * self.tokens, dtype=np.int64) % 50

    def options(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "namespace": self.namespace,
            "estimator": self.preset,
            "return": list(self.returns),
            "ignore_token_ids": list(self.ignore),
        }


def as_json(req: Request) -> bytes:
    ids = req.token_ids().tolist()
    rows = iter(range(len(req.group_index())))

    def rollout(row: int) -> dict[str, Any]:
        tokens = ids[row * req.tokens : (row + 1) * req.tokens]
        teacher = {c: [-0.5] * req.tokens for c in req.conditions}
        return {"tokens": tokens, "reward": float(row % 2), "teacher_logprobs": teacher}

    groups = [
        {"id": f"g{g}", "rollouts": [rollout(next(rows)) for _ in range(size)]}
        for g, size in enumerate(req.rollouts)
    ]
    return json.dumps({**req.options(), "groups": groups}).encode()


def as_arrow(req: Request) -> bytes:
    index = req.group_index()
    tokens = req.token_ids()
    table = request_table(
        group_ids=[f"g{g}" for g in range(len(req.rollouts))],
        group_index=index,
        offsets=np.arange(len(index) + 1) * req.tokens,
        tokens=tokens.astype(np.int32),
        rewards=(np.arange(len(index)) % 2).astype(np.float64),
        per_token={},
        teacher_logprobs={c: np.full(len(tokens), -0.5, np.float32) for c in req.conditions},
        options_json=json.dumps(req.options()),
    )
    return stream_bytes(table)


def as_grpc(req: Request) -> bytes:
    index = req.group_index()
    tokens = req.token_ids()

    def tensor(values: np.ndarray, dtype: int) -> pb.Tensor:
        return pb.Tensor(dtype=dtype, data=values.tobytes())

    message = pb.ComputeRequest(
        request_id=req.request_id,
        options=pb.ComputeOptions(
            namespace=req.namespace,
            preset=req.preset,
            returns=list(req.returns),
            ignore_token_ids=list(req.ignore),
        ),
        group_ids=[f"g{g}" for g in range(len(req.rollouts))],
        group_index=tensor(index.astype("<i8"), pb.DTYPE_INT64),
        offsets=tensor((np.arange(len(index) + 1) * req.tokens).astype("<i8"), pb.DTYPE_INT64),
        tokens=tensor(tokens.astype("<i8"), pb.DTYPE_INT64),
        rewards=tensor((np.arange(len(index)) % 2).astype("<f8"), pb.DTYPE_FLOAT64),
    )
    for condition in req.conditions:
        message.teacher_logprobs[condition].CopyFrom(
            tensor(np.full(len(tokens), -0.5, "<f4"), pb.DTYPE_FLOAT32)
        )
    return message.SerializeToString()


ENCODERS: dict[str, Callable[[Request], bytes]] = {
    "json": as_json,
    "arrow": as_arrow,
    "grpc": as_grpc,
}
LIMITS = RequestLimits(max_tokens=40, max_rollouts=8, max_group_size=8, max_arrow_batches=8)

# (the request, the answer every wire gives it: (status, field), or None: it passes)
CASES: dict[str, tuple[Request, tuple[int, str] | None]] = {
    "within every bound": (Request(), None),
    "more rollouts than the limit": (Request(rollouts=(4, 5)), (413, "rollouts")),
    "more tokens than the limit": (Request(tokens=11), (413, "tokens")),
    "a teacher condition's name too long": (
        Request(conditions=("c" * (MAX_CONDITION_NAME_LENGTH + 1),)),
        (413, "teacher_logprobs"),
    ),
    "more teacher conditions than the limit": (
        Request(
            rollouts=(1,),
            tokens=1,
            conditions=tuple(f"c{i}" for i in range(MAX_TEACHER_CONDITIONS + 1)),
        ),
        (413, "teacher_logprobs"),
    ),
    "a request_id too long": (
        Request(request_id="r" * (MAX_REQUEST_ID_LENGTH + 1)),
        (413, "request_id"),
    ),
    "more ignore_token_ids than the limit": (
        Request(ignore=(1,) * (MAX_IGNORE_TOKEN_IDS + 1)),
        (413, "ignore_token_ids"),
    ),
    "a namespace too long": (
        Request(namespace="n" * (MAX_NAMESPACE_LENGTH + 1)),
        (422, "namespace"),
    ),
    "a preset name too long": (Request(preset="p" * (MAX_NAME_LENGTH + 1)), (422, "estimator")),
    "more return names than the limit": (
        Request(returns=("scalar",) * (MAX_RETURN_NAMES + 1)),
        (422, "return"),
    ),
}


def answer(pre_parser: PreParser[bytes, object], body: bytes) -> tuple[int, str | None] | None:
    try:
        pre_parser(body, LIMITS)
    except RequestError as exc:
        return exc.status, exc.field
    return None


def test_the_table_has_a_pre_parser_for_every_wire_format() -> None:
    assert sorted(PRE_PARSERS) == sorted(ENCODERS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_wire_format_answers_a_request_alike(case: str) -> None:
    request, expected = CASES[case]
    answers = {fmt: answer(parse, ENCODERS[fmt](request)) for fmt, parse in PRE_PARSERS.items()}
    assert answers == dict.fromkeys(ENCODERS, expected)


def test_a_limit_of_the_settings_is_the_same_bound_on_every_wire() -> None:
    """A request at the rollout limit passes every pre-parser, and the same request under a
    limit one lower is refused by each: the limits value alone decides."""
    request = Request(rollouts=(3, 3))
    for fmt, pre_parser in PRE_PARSERS.items():
        body = ENCODERS[fmt](request)
        pre_parser(body, replace(LIMITS, max_rollouts=6))
        with pytest.raises(RequestError) as info:
            pre_parser(body, replace(LIMITS, max_rollouts=5))
        assert (info.value.status, info.value.field) == (413, "rollouts")
