"""Clean virtual environments built by the install commands the documentation gives, exactly as
written, run from a copy of the repository's files (as a user's clone), cached.

Each environment is a list of steps, each a documented shell command run by ``bash`` in the
copy with the environment's ``bin`` first on ``PATH`` (so ``pip`` is its pip). The CPU build of
torch is installed first the way the documentation tells a CPU machine to; this machine's pip
finds it in its wheel folder (no other index is reachable here), so that step is
``pip install torch==2.13.0`` (see :data:`TORCH_CPU`).

An environment is kept under the trainer environments' cache (tests/trainer_envs.py), keyed by
a digest of its steps, the interpreter's version and the contents of the pyproject files its
steps install (what pip resolves): a changed pin builds a new one (a minute or two once pip's
own cache holds the wheels) and removes the one before, a rerun reuses it in seconds. The editable
installs point into the copy kept inside the cached environment, never into the checkout, so
the cache serves every clone; the examples run with the checkout's own code first on the path
(the code under test), on the dependencies the documented command resolved.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer_envs import CACHE, ROOT, python_version

# The documented command for a CPU machine, and what stands in for it here (the same release,
# from this machine's wheel folder, which pip's configuration names).
TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_HERE = "pip install torch==2.13.0"
# What a clone holds that the install commands read.
COPIED = ("clients/python", "service", "pyproject.toml", "README.md", "LICENSE")


@dataclass(frozen=True)
class InstallEnv:
    """A clean environment and the documented commands that build it, in order."""

    name: str
    steps: tuple[str, ...]

    def digest(self) -> str:
        version = python_version(sys.executable)
        read = {"client": (ROOT / "clients/python/pyproject.toml").read_text()}
        if any(step.split()[-1] == "." for step in self.steps):  # (the service itself)
            read["service"] = (ROOT / "pyproject.toml").read_text()
        blob = json.dumps({"steps": self.steps, "python": version, **read}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def home(self) -> Path:
        return CACHE / "installs" / f"{self.name}-{self.digest()}"


def _copy_clone(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", "node_modules")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        elif source.exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _run_step(home: Path, command: str, log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{home / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(home)
    run = TORCH_HERE if command == TORCH_CPU else command
    with log.open("a") as out:
        out.write(f"$ {run}\n")
        out.flush()
        done = subprocess.run(
            ["bash", "-c", run], cwd=home / "clone", env=env, stdout=out, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        raise AssertionError(
            f"`{command}` failed in a clean environment:\n{log.read_text()[-5000:]}"
        )


def ensure_install_env(spec: InstallEnv) -> Path:
    """The environment's python, built by its documented commands on first use."""
    home = spec.home()
    home.parent.mkdir(parents=True, exist_ok=True)
    with (home.parent / f".{spec.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / ".complete").exists():
            return home / "bin" / "python"
        if home.exists():
            shutil.rmtree(home)  # an interrupted build
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(home)], check=True)
        _copy_clone(home / "clone")
        log = home / "build.log"
        print(f"building the {spec.name} install environment in {home} (cached afterwards)")
        for command in spec.steps:
            _run_step(home, command, log)
        (home / ".complete").write_text(json.dumps(spec.steps))
        for stale in home.parent.glob(f"{spec.name}-*"):  # (earlier pins: GBs each)
            if stale != home and stale.name[len(spec.name) + 1 :].isalnum():
                shutil.rmtree(stale, ignore_errors=True)
    return home / "bin" / "python"
