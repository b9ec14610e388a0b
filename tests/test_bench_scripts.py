"""Every benchmark script starts: ``bench/<script> --help`` imports what it imports and prints
its usage, in the environment it runs in (the JAX one for those that import jax). Three scripts
once imported a helper that had moved (``bench_bodies``, ``bench_cluster``, ``bench_fleet``)
and no run noticed until their figures were to be measured again. (One process runs every
script's ``--help`` as ``__main__``, so that torch and the rest are imported once.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_envs import ensure_env, run_in_env
from trainers.jax_support import JAX_ENV

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))

# Runs each script given as an argument with --help, as __main__; prints, per script, its exit
# code, whether what it printed starts with argparse's "usage:", and its traceback if any.
DRIVER = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for path in sys.argv[1:]:
    printed, code, error = io.StringIO(), None, None
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        error = traceback.format_exc()[-3000:]
    out[path] = {"code": code, "usage": printed.getvalue().startswith("usage:"), "error": error}
print(json.dumps(out))
"""

pytestmark = pytest.mark.integration


def uses_jax(path: Path) -> bool:
    return re.search(r"^import jax\b", path.read_text(), re.MULTILINE) is not None


def test_every_benchmark_script_imports_and_prints_its_usage() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"bench_cluster.py", "bench_jax_callback.py"} <= names and len(names) >= 10
    plain = [str(p) for p in SCRIPTS if not uses_jax(p)]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *plain],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    with_jax = [p for p in SCRIPTS if uses_jax(p)]
    assert with_jax
    ran = run_in_env(
        ensure_env(JAX_ENV), "\n" + DRIVER, *map(str, with_jax), service=True, timeout=300
    )
    said.update(json.loads(ran.stdout.splitlines()[-1]))
    assert set(said) == {str(p) for p in SCRIPTS}
    failed = {Path(p).name: r for p, r in said.items() if r["code"] != 0 or not r["usage"]}
    assert not failed, failed
