"""Every benchmark script starts: ``python bench/<script> --help`` imports what it imports and
prints its usage, in the environment it runs in (the JAX one for those that import jax). Three
scripts once imported a helper that had moved (``bench_bodies``, ``bench_cluster``,
``bench_fleet``) and no run noticed until their figures were to be measured again."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_envs import ensure_env, run_in_env
from trainers.jax_support import JAX_ENV

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(path.name for path in BENCH.glob("bench_*.py"))

pytestmark = pytest.mark.integration


def test_the_scripts_are_found() -> None:
    assert {"bench_cluster.py", "bench_jax_callback.py"} <= set(SCRIPTS) and len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_imports_and_prints_its_usage(script: str) -> None:
    path = BENCH / script
    if re.search(r"^import jax\b", path.read_text(), re.MULTILINE):
        done = run_in_env(ensure_env(JAX_ENV), path, "--help", service=True, timeout=300)
    else:
        done = subprocess.run(
            [sys.executable, str(path), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
