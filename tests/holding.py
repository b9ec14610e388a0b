"""A term registered for one test that makes the engine's workers observable and holdable through
the public registry: with ``{"hold": {"block": true}}`` its computation blocks until the test
releases it (a busy worker), and every computation that has it records the group ids of its
batch, in the order computations ran (merged requests show up together)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from advantage_service.batch import RolloutBatch
from advantage_service.estimators.registry import (
    TERMS,
    Param,
    TermContext,
    TermOutput,
    register_term,
)

NAME = "hold"


class Hold:
    """``with Hold() as hold:`` registers the term; ``hold.release.set()`` lets blocked
    computations go on (they give up after ``timeout`` seconds)."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.release = threading.Event()
        self.blocked = threading.Event()  # set when a blocking computation has started
        self.computed: list[list[str]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Hold:
        @register_term(
            NAME,
            formula="b_it = 0",
            paper="(a test term)",
            params=(Param("block", bool, False, "block until the test releases it"),),
            diagnostics=(),
            requires=lambda params: {},
        )
        def hold(batch: RolloutBatch, params: Mapping[str, Any], ctx: TermContext) -> Any:
            """Records the batch's groups; blocks while the test holds it."""
            with self._lock:
                self.computed.append(list(batch.group_ids))
            if params["block"]:
                self.blocked.set()
                if not self.release.wait(self.timeout):
                    raise RuntimeError("the test never released the held computation")
            return TermOutput(bonus=torch.zeros(batch.num_tokens, device=batch.device))

        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release.set()
        TERMS.pop(NAME, None)


def held_request(group: str = "held", block: bool = True, **fields: Any) -> dict[str, Any]:
    """A small request with the hold term (blocking by default)."""
    return {
        "estimator": {"outcome": "grpo", NAME: {"block": block}},
        "groups": [
            {
                "id": group,
                "rollouts": [{"tokens": [1, 2], "reward": 1.0}, {"tokens": [3], "reward": 0.0}],
            }
        ],
        **fields,
    }
