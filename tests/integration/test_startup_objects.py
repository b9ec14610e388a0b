"""``serve`` keeps the objects of its start-up (modules, torch, numba, the compiled loops) out of
the cyclic collector once it is warm and before it reports ready: a full collection walks every
tracked object with the GIL held, and over the start-up's ~330,000 it paused every request for
160-170 ms every few seconds under load (bench/bench_load.py; README, "Load")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from advantage_client import HttpClient
from service_support import Service

REQUEST = {
    "estimator": "ktae",
    "groups": [
        {
            "id": "p",
            "rollouts": [
                {"tokens": [11, 12, 13], "reward": 1.0},
                {"tokens": [11, 14], "reward": 0.0},
            ],
        }
    ],
}


@pytest.mark.integration
def test_the_start_up_objects_are_frozen_before_the_service_is_ready(tmp_path: Path) -> None:
    service = Service.start(tmp_path, log_level="info")
    try:
        HttpClient(service.url).compute(REQUEST)
        output = service.output()
    finally:
        service.stop()
    frozen = re.search(r"(\d+) objects of the start-up kept out of the collector", output)
    assert frozen is not None, output[-2000:]
    assert int(frozen.group(1)) > 100_000  # (torch's modules alone are more)
    assert frozen.start() < output.index("ready on")
