"""Virtual environments for trainers whose pins clash with the development environment, cached.

A trainer's tests run its own advantage step in the environment its users have: a virtual
environment holding the trainer's package (often ``--no-deps``, plus the few modules its advantage
step imports) and the client's dependencies. Building one takes a minute or more, so each is kept
under a cache directory keyed by a digest of everything that goes into it (interpreter version,
package lists, pip flags); a changed list builds a new one beside the old.

The checkout's own packages are never installed into a cached environment (an editable install
would tie it to one clone): :func:`run_in_env` puts ``clients/python`` (and ``service`` where asked)
on ``PYTHONPATH`` instead, so a cached environment serves every clone on this machine.

Building is serialised by a file lock and marked complete only at the end, so two test processes
never use a half-built environment, and an interrupted build is redone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENT_SRC = ROOT / "clients" / "python"
SERVICE_SRC = ROOT / "service"
CACHE = Path(
    os.environ.get(
        "ADV_TRAINER_ENVS", Path.home() / ".cache" / "advantage-service" / "trainer-envs"
    )
)
# What the client itself imports (clients/python/pyproject.toml's dependencies), installed into
# every trainer environment because the client is put on PYTHONPATH rather than installed.
CLIENT_REQUIREMENTS = (
    "numpy>=1.26",
    "httpx>=0.27",
    "grpcio>=1.85.1",
    "protobuf>=7.35.1,<8",
    "pyarrow>=15",
)
# The CPU build of torch lies on this machine's wheel folder (pip finds it by its configured
# find-links); the package index has only CUDA builds for Linux.
TORCH = "torch==2.13.0"


def service_requirements() -> tuple[str, ...]:
    """The service's runtime dependencies (pyproject.toml), for environments that compute
    in-process; torch pinned to the CPU build, the client distribution left out (on the path)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    kept = [d for d in deps if not d.startswith(("advantage-client", "torch"))]
    return (TORCH, *kept)


def python_version(python: str | Path) -> str:
    """``sys.version`` of an interpreter as it prints it (newline included): part of what keys
    a cached environment."""
    return subprocess.run(
        [str(python), "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@dataclass(frozen=True)
class EnvSpec:
    """What goes into one environment.

    ``packages``: installed with their dependencies, in one resolve (constraints from the
    machine's pip configuration apply). ``no_deps``: installed afterwards with ``--no-deps`` (a
    trainer whose pins clash; its advantage step's imports go in ``packages``). ``python``: the
    interpreter that creates the venv. ``pip_flags``: extra flags for the ``no_deps`` step (e.g.
    ``--ignore-requires-python``).
    """

    name: str
    packages: tuple[str, ...] = ()
    no_deps: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: getattr(sys, "_base_executable", sys.executable))
    pip_flags: tuple[str, ...] = ()
    client_requirements: bool = True

    def digest(self) -> str:
        version = python_version(self.python).strip()
        blob = json.dumps(
            {
                "name": self.name,
                "packages": self.packages,
                "no_deps": self.no_deps,
                "python": version,
                "pip_flags": self.pip_flags,
                "client": CLIENT_REQUIREMENTS if self.client_requirements else (),
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _pip(python: Path, args: Sequence[str], log: Path) -> None:
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args]
    with log.open("a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"building the {log.parent.name} environment failed:\n{tail}")


def ensure_env(spec: EnvSpec) -> Path:
    """The environment's python, built on first use and reused afterwards."""
    home = CACHE / f"{spec.name}-{spec.digest()}"
    CACHE.mkdir(parents=True, exist_ok=True)
    python = home / "bin" / "python"
    complete = home / ".complete"
    with (CACHE / f".{spec.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete.exists():
            return python
        if home.exists():
            shutil.rmtree(home)  # an interrupted build
        subprocess.run([spec.python, "-m", "venv", str(home)], check=True)
        log = home / "build.log"
        print(f"building the {spec.name} test environment in {home} (cached afterwards)")
        requirements = [*(CLIENT_REQUIREMENTS if spec.client_requirements else ()), *spec.packages]
        if requirements:
            _pip(python, requirements, log)
        if spec.no_deps:
            _pip(python, ["--no-deps", *spec.pip_flags, *spec.no_deps], log)
        complete.write_text(json.dumps({"packages": spec.packages, "no_deps": spec.no_deps}))
    return python


def _service_metadata() -> Path:
    """A folder holding the service's distribution metadata (its entry points), so that the
    contract finds the in-process backend through its entry point, as in an installed service,
    with the service's code taken from the checkout on PYTHONPATH."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in entries.items())
    text = "\n".join(lines) + "\n"
    folder = CACHE / "_service-metadata" / hashlib.sha256(text.encode()).hexdigest()[:16]
    info = folder / f"advantage_service-{project['version']}.dist-info"
    if not (info / "entry_points.txt").exists():
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: advantage-service\nVersion: {project['version']}\n"
        )
        (info / "entry_points.txt").write_text(text)
    return folder


def env_vars(*, service: bool = False, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables that put the checkout's client (and service) on the path."""
    paths = [str(CLIENT_SRC)]
    if service:
        paths += [str(SERVICE_SRC), str(_service_metadata())]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra or {})
    return env


def run_in_env(
    python: Path,
    script: str | Path,
    *args: str,
    service: bool = False,
    extra_env: Mapping[str, str] | None = None,
    timeout: float = 600,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a script file (or ``-c`` code when ``script`` holds a newline) in the environment;
    raises with its output when it fails, so a test's failure shows the trainer's traceback."""
    target = ["-c", script] if isinstance(script, str) and "\n" in script else [str(script)]
    done = subprocess.run(
        [str(python), *target, *args],
        capture_output=True,
        text=True,
        env=env_vars(service=service, extra=extra_env),
        timeout=timeout,
        cwd=cwd,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"{script} failed in {python.parent.parent.name} (exit {done.returncode}):\n"
            f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
        )
    return done


def package_version(python: Path, distribution: str) -> str:
    """The installed version of ``distribution`` in the environment (importlib.metadata)."""
    code = f"import importlib.metadata as m\nprint(m.version({distribution!r}))"
    return run_in_env(python, code).stdout.strip()
