"""clients/examples/numpy_trainer.py, the "any framework" recipe, runs against a real service
over both transports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "clients" / "examples" / "numpy_trainer.py"


@pytest.mark.integration
@pytest.mark.parametrize(("flag", "estimator"), [("--url", "ktae"), ("--grpc", "rloo")])
def test_numpy_trainer_example_trains_on_the_services_advantages(
    service: Any, flag: str, estimator: str
) -> None:
    address = service.url if flag == "--url" else service.target
    before = service.requests()
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), flag, address, "--estimator", estimator, "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    steps = [json.loads(line) for line in run.stdout.splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["zero_off_mask"] and s["advantage_abs_mean"] > 0 for s in steps)
    if estimator == "ktae":  # token-level credit: values differ within a row
        assert any(s["distinct_in_row"] > 1 for s in steps)
    else:
        assert all(s["distinct_in_row"] == 1 for s in steps)
    assert service.requests() == before + 3
