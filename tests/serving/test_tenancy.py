"""The budget rule (serving/tenancy.py): each tenant holds at most its share of each resource,
the replica at most its total; the tokens file's limits override a share; what is given back
is free again; a lone request's bytes are never refused for their number."""

from __future__ import annotations

import asyncio

import pytest
from advantage_service.config import Settings
from advantage_service.errors import Overloaded
from advantage_service.serving.engine import Engine
from advantage_service.serving.tenancy import Budget, Limits, Refusal, Tenant

TOTAL = Limits(bodies=8, requests=10, bytes=1000, streams=4)
A, B, C = Tenant("a", "a"), Tenant("b", "b"), Tenant("c", "c")


def test_one_tenant_at_its_share_leaves_the_rest_to_others() -> None:
    budget = Budget(TOTAL, 0.5)
    for _ in range(5):
        budget.take(A, "requests")
    with pytest.raises(Refusal) as refused:
        budget.take(A, "requests")
    assert "'a' holds 5 requests" in str(refused.value) and "ADV_MAX_QUEUE" in str(refused.value)
    for _ in range(5):  # the other half is b's
        budget.take(B, "requests")
    # The replica's total binds a third tenant though it holds nothing.
    with pytest.raises(Refusal) as full:
        budget.take(C, "requests")
    assert "the service holds 10 requests" in str(full.value)
    budget.give(A, "requests")
    budget.take(C, "requests")
    assert (budget.usage(A).requests, budget.usage(B).requests, budget.used.requests) == (4, 5, 10)


def test_shares_round_up_and_are_at_least_one() -> None:
    budget = Budget(Limits(bodies=1, requests=3, bytes=7, streams=1), 0.5)
    assert budget.default == Limits(bodies=1, requests=2, bytes=4, streams=1)


def test_a_tokens_file_limit_overrides_the_share_and_whole_tenants_have_the_total() -> None:
    budget = Budget(TOTAL, 0.5)
    narrow = Tenant("n", "n", {"streams": 1})
    wide = Tenant("w", "w", {"streams": 4})
    budget.take(narrow, "streams")
    with pytest.raises(Refusal):
        budget.take(narrow, "streams")
    for _ in range(3):
        budget.take(wide, "streams")  # its own limit passes the default share of 2
    assert budget.limits(Tenant("local", "local", whole=True)) == TOTAL


def test_a_lone_request_is_never_refused_for_its_bytes() -> None:
    budget = Budget(TOTAL, 0.5)
    budget.take(A, "bytes", 5000)  # nothing else held: over both the share and the total
    with pytest.raises(Refusal):
        budget.take(B, "bytes", 1)  # the replica is past its total: b holds none but is refused
    budget.give(A, "bytes", 5000)
    budget.take(B, "bytes", 300)
    budget.take(A, "bytes", 600)  # a holds nothing else: its share does not refuse it
    with pytest.raises(Refusal) as refused:
        budget.take(A, "bytes", 1)  # now a holds bytes: 601 > its 500
    assert "'a' holds 600 bytes" in str(refused.value)
    assert budget.used.bytes == 900
    # A body growing past what it declared: when its own bytes are all the tenant holds, the
    # share does not refuse it (the replica's total still does).
    budget.give(B, "bytes", 300)
    budget.take(A, "bytes", 300, own=600)
    budget.take(B, "bytes", 50)
    with pytest.raises(Refusal) as over:
        budget.take(A, "bytes", 60, own=900)
    assert "the service holds 950 bytes" in str(over.value)


def test_refusals_and_holdings_are_reported_per_tenant_label() -> None:
    held: dict[tuple[str, str], int] = {}
    refused: list[tuple[str, str]] = []
    budget = Budget(
        TOTAL,
        0.5,
        on_held=lambda label, r, n: held.__setitem__((label, r), held.get((label, r), 0) + n),
        on_refused=lambda label, r: refused.append((label, r)),
    )
    anonymous = [Tenant(f"address:{n}", "anonymous") for n in range(2)]
    budget.take(anonymous[0], "bodies")
    budget.take(anonymous[1], "bodies")
    budget.take(A, "streams")
    budget.take(A, "streams")
    with pytest.raises(Refusal):
        budget.take(A, "streams")
    assert held == {("anonymous", "bodies"): 2, ("a", "streams"): 2}
    assert refused == [("a", "streams")]


def test_a_body_being_received_holds_no_place_among_the_requests() -> None:
    """With ADV_MAX_QUEUE 2: two bodies arriving leave both places to ready requests; a body
    that is whole takes a place then (and is refused if there is none)."""
    engine = Engine(Settings(device="cpu", max_queue=2, max_receiving=4, tenant_share=1.0))

    async def scenario() -> None:
        slow = [engine.admit(10, A, receiving=True) for _ in range(2)]
        ready = [engine.admit(10, B), engine.admit(10, B)]
        assert engine.scheduler.held == 2 and engine.scheduler.receiving == 2
        with pytest.raises(Overloaded):  # the queue is full: refused before its body is read
            engine.admit(10, C, receiving=True)
        with pytest.raises(Overloaded) as refused:
            slow[0].received()
        assert "ADV_MAX_QUEUE" in refused.value.message
        ready[0].release()
        slow[0].received()
        assert engine.scheduler.held == 2 and engine.scheduler.receiving == 1
        for ticket in [*slow, *ready]:
            ticket.release()
        assert (engine.scheduler.held, engine.scheduler.receiving, engine.scheduler.held_bytes) == (
            0,
            0,
            0,
        )

    asyncio.run(scenario())
    engine.close()
