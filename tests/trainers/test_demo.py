"""The learning demo's summary (clients/examples/trl_demo.py) and what `make demo` installs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "examples"))

import trl_demo  # noqa: E402


def records(rewards: list[float]) -> list[dict[str, float]]:
    return [{"step": i + 1, "reward": r, "pass_rate": r / 2} for i, r in enumerate(rewards)]


def test_the_table_gives_each_seeds_mean_over_the_last_steps_and_their_mean() -> None:
    last = trl_demo.LAST
    runs = {
        "A": {0: records([0.0] * 5 + [0.5] * last), 1: records([1.0] * 5 + [0.25] * last)},
        "B": {0: records([0.1] * (last + 5)), 1: records([0.3] * (last + 5))},
    }
    lines = trl_demo.table(runs).splitlines()
    assert lines[0] == "| run | seed 0 | seed 1 | mean |"
    assert "| A: reward | 0.500 | 0.250 | 0.375 |" in lines
    assert "| B: reward | 0.100 | 0.300 | 0.200 |" in lines
    assert "| A: pass rate | 0.250 | 0.125 | 0.188 |" in lines


def test_the_plot_draws_every_arm(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = {"A": {0: records([0.1, 0.2]), 1: records([0.3, 0.4])}, "B": {0: records([0.0, 0.1])}}
    trl_demo.plot(runs, tmp_path / "demo.png", "title")
    assert (tmp_path / "demo.png").stat().st_size > 1000


@pytest.mark.integration  # (it runs make, a process: not in the quick loop)
def test_make_demo_installs_only_what_serving_and_the_demo_need() -> None:
    # A dry run from a tree where no environment exists: the demo's recipe must not build the
    # whole development environment (`make install`, whose stamp is .installed).
    plan = subprocess.run(
        ["make", "-n", "demo", "VENV=/nonexistent-venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "'.[dev]'" not in plan and "verl" not in plan
    assert "clients/python[trl]" in plan and "matplotlib" in plan
    assert "trl_demo.py --start-service" in plan
