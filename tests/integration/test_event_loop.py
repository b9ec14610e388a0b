"""The event loop under HTTP and gRPC (``ADV_EVENT_LOOP``): uvloop by default where installed
(the service's install has it), asyncio on request; a service on either answers both transports
the same advantages, and one asked for uvloop without it says so instead of starting."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from advantage_client import GrpcClient, HttpClient
from advantage_service.transports.server import loop_factory
from service_support import Service

REQUEST = {
    "estimator": "ktae",
    "groups": [
        {
            "id": "p",
            "rollouts": [
                {"tokens": [11, 12, 13, 14], "reward": 1.0},
                {"tokens": [11, 15, 16], "reward": 0.0},
                {"tokens": [11, 12, 17], "reward": 1.0},
            ],
        }
    ],
}


def test_auto_takes_uvloop_where_installed_and_uvloop_without_it_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uvloop

    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    monkeypatch.setitem(sys.modules, "uvloop", None)  # (as if not installed: import fails)
    assert loop_factory("auto") is None
    with pytest.raises(RuntimeError, match="ADV_EVENT_LOOP=uvloop, but uvloop is not installed"):
        loop_factory("uvloop")


@pytest.mark.integration
def test_a_service_on_either_loop_answers_both_transports_alike(tmp_path: Path) -> None:
    answers = {}
    for choice, named in (("auto", "uvloop"), ("asyncio", "asyncio")):
        service = Service.start(tmp_path, event_loop=choice, log_level="info")
        try:
            # (a namespace each: no KTAE history from one call in another's answer)
            http = HttpClient(service.url).compute({**REQUEST, "namespace": f"{choice}-http"})
            grpc = GrpcClient(service.target).compute({**REQUEST, "namespace": f"{choice}-grpc"})
            answers[f"{choice} http"] = http["groups"][0]["rollouts"]
            answers[f"{choice} grpc"] = grpc["groups"][0]["rollouts"]
            assert f"event loop: {named}" in service.output()
        finally:
            service.stop()
    first, *others = answers.values()
    assert any(np.any(rollout["advantages"] != 0) for rollout in first)
    for other in others:
        for a, b in zip(first, other, strict=True):
            np.testing.assert_array_equal(a["advantages"], b["advantages"])
