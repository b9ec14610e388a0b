"""The stateful-term protocol is a real seam: a term defined here, in the tests alone, keeps
per-prompt state in Redis through the service's HTTP app without a line of the engine, the
stats store or the transports knowing it.

The toy term is a running mean reward baseline: each prompt's record holds the sum and count of
the rewards of its earlier visits, and the term's bonus is minus their mean, so with the
``reinforce`` outcome (a_i = r_i) a rollout's advantage is r_i - mean(earlier rewards of its
prompt), and r_i on a prompt's first visit.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import torch
from advantage_service.batch import RolloutBatch
from advantage_service.config import Settings
from advantage_service.estimators.baselines import group_sum
from advantage_service.estimators.registry import TERMS, TermContext, TermOutput, register_term
from advantage_service.estimators.state import TermState, TermWrites, WriteOptions
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.transports.http import create_app

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

NAME = "running_mean"
SPACE = "running-mean"


def _keys(batch: RolloutBatch, params: Mapping[str, Any]) -> list[str]:
    return list(batch.group_ids)


def _decode(records: Sequence[bytes | None], device: torch.device) -> torch.Tensor:
    """float64 (G, 2): each prompt's earlier reward sum and count (0, 0 without a record)."""
    rows = [[0.0, 0.0] if r is None else json.loads(r)["sum_count"] for r in records]
    return torch.tensor(rows, dtype=torch.float64, device=device).reshape(-1, 2)


def _writes(
    batch: RolloutBatch,
    params: Mapping[str, Any],
    own: torch.Tensor,
    prior: torch.Tensor | None,
    options: WriteOptions,
) -> TermWrites:
    if prior is None:
        return TermWrites()
    totals = (prior.cpu() + own.cpu()).tolist()
    return TermWrites(
        records={
            gid: json.dumps({"sum_count": row}).encode()
            for gid, row in zip(batch.group_ids, totals, strict=True)
        }
    )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def running_mean_term() -> Iterator[None]:
    """Register the toy term in this process for one test (the real registration path)."""

    @register_term(
        NAME,
        formula="b_it = -mean(rewards of the prompt's earlier visits)",
        paper="(a test of the stateful-term protocol)",
        params=(),
        diagnostics=(),
        requires=lambda params: {},
        state=TermState(writes=_writes, space=SPACE, keys=_keys, decode=_decode),
    )
    def running_mean(batch: RolloutBatch, params: Mapping[str, Any], ctx: TermContext) -> Any:
        """Minus the running mean reward of each rollout's prompt."""
        prior = None if ctx.read is None else ctx.read.result()
        own = torch.stack([group_sum(batch, batch.rewards.double()), batch.group_sizes.double()], 1)
        if prior is None:
            mean = torch.zeros(batch.num_groups, dtype=torch.float64, device=batch.device)
        else:
            mean = prior[:, 0] / prior[:, 1].clamp(min=1.0)
        per_rollout = mean.index_select(0, batch.group_index)
        return TermOutput(bonus=batch.per_token(-per_rollout.float()), state=own)

    try:
        yield
    finally:
        del TERMS[NAME]


@pytest.fixture
async def client(redis_server: Any, running_mean_term: None) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(device="cpu", redis_url=redis_server.url)
    engine = Engine(settings, Metrics(process=False))
    app = create_app(settings, engine)
    engine.warm_up()
    await engine.start()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://service") as http:
        http.engine = engine  # type: ignore[attr-defined]
        yield http
    await engine.flush()
    engine.close()


def visit(rewards: dict[str, list[float]]) -> dict[str, Any]:
    return {
        "namespace": "seam",
        "estimator": {"outcome": "reinforce", NAME: {}},
        "groups": [
            {"id": gid, "rollouts": [{"tokens": [1, 2, 3], "reward": r} for r in rs]}
            for gid, rs in rewards.items()
        ],
    }


async def test_a_term_defined_outside_the_service_keeps_state_through_http_on_redis(
    client: httpx.AsyncClient, redis_server: Any
) -> None:
    listing = (await client.get("/v1/estimators")).text
    assert NAME in listing
    visits = [
        {"p": [1.0, 0.0, 1.0, 1.0], "q": [0.0, 0.0]},
        {"p": [0.0, 0.0], "q": [1.0, 1.0, 0.0]},
        {"p": [1.0, 1.0], "r": [0.5, 0.5]},
    ]
    earlier: dict[str, list[float]] = {}
    for number, rewards in enumerate(visits):
        response = await client.post("/v1/advantages", json=visit(rewards))
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["summary"]["history"] == "applied"
        for group in body["groups"]:
            seen = earlier.get(group["id"], [])
            mean = float(np.mean(seen)) if seen else 0.0
            for rollout, reward in zip(group["rollouts"], rewards[group["id"]], strict=True):
                np.testing.assert_allclose(rollout["advantages"], [reward - mean] * 3, rtol=1e-6)
        for gid, rs in rewards.items():
            earlier.setdefault(gid, []).extend(rs)
        await client.engine.settle_writes()  # type: ignore[attr-defined]
        # By the third visit the state has changed an answer (p's earlier mean is 0.5).
        if number == 2:
            p = next(g for g in body["groups"] if g["id"] == "p")
            assert p["rollouts"][0]["advantages"][0] == pytest.approx(0.5)
    # The records are the term's, in its own key space, in the real Redis.
    admin = redis.Redis.from_url(redis_server.url)
    stored = json.loads(admin.get("adv:{seam}:running-mean:p"))
    assert stored["sum_count"] == [sum(earlier["p"]), len(earlier["p"])]
    admin.close()
