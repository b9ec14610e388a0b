"""The Dockerfile: hadolint-clean, multi-stage, non-root, CPU by default and CUDA by build
argument, and a build context that holds everything the builder stage installs.

No container engine runs in the test environment, so the image is not built here; the builder's
``pip install ./clients/python`` and ``pip install .`` are reproduced on exactly the files its COPY
lines bring in.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from advantage_service.config import Settings
from deploy_support import DOCKERFILE, DOCKERIGNORE, ROOT, tool


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs (name -> default) and the stages, each with its (KEYWORD, arguments) list;
    continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.IGNORECASE)
            assert match, line
            stages.append(Stage(match.group(1), match.group(2) or ""))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM: {line}"
            name, _, default = args.partition("=")
            global_args[name.strip()] = default.strip()
        else:
            stages[-1].instructions.append((keyword, args.strip()))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage], Stage]:
    global_args, stages = parse(DOCKERFILE.read_text())
    return global_args, {s.name: s for s in stages}, stages[-1]


@pytest.mark.integration
def test_hadolint_passes_at_the_strictest_threshold() -> None:
    hadolint = tool("hadolint")
    assert hadolint, "hadolint is missing: install the dev extra (pip install -e '.[dev]')"
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", "--format", "json", DOCKERFILE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    assert result.returncode == 0 and not findings, json.dumps(findings, indent=1) + result.stderr


def test_device_build_argument_defaults_to_cpu_and_selects_a_runtime_stage(dockerfile) -> None:
    global_args, stages, _ = dockerfile

    def expand(text: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], text)

    assert global_args.get("DEVICE") == "cpu"
    assert stages["runtime"].base == "runtime-${DEVICE}"
    assert expand(stages["runtime-cpu"].base).startswith("python:3.")
    assert expand(stages["runtime-cuda"].base).startswith("nvidia/cuda:")
    # Each runtime names the torch wheel index for its device.
    cpu_env = expand(" ".join(stages["runtime-cpu"].all("ENV")))
    cuda_env = expand(" ".join(stages["runtime-cuda"].all("ENV")))
    assert "download.pytorch.org/whl/cpu" in cpu_env
    assert re.search(r"download\.pytorch\.org/whl/cu\d+", cuda_env)


def test_builder_and_final_stages_share_the_runtime_base(dockerfile) -> None:
    # The venv's interpreter symlinks point into the base image: both stages need the same one.
    _, stages, final = dockerfile
    assert stages["builder"].base == "runtime"
    assert final.base == "runtime"


def test_builder_installs_torch_from_the_device_index_then_the_client_then_the_service(
    dockerfile,
) -> None:
    # The service depends on advantage-client, which no index serves: it must be there first.
    _, stages, _ = dockerfile
    runs = stages["builder"].all("RUN")
    torch_step = next(i for i, r in enumerate(runs) if "torch==" in r)
    client_step = next(
        i for i, r in enumerate(runs) if "pip install" in r and "clients/python" in r
    )
    service_step = next(i for i, r in enumerate(runs) if re.search(r"pip install .*\s\.(\s|$)", r))
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_step]
    assert torch_step < client_step < service_step


def test_final_stage_has_no_build_tools_and_only_the_venv_from_the_builder(dockerfile) -> None:
    _, _, final = dockerfile
    runs = " ".join(final.all("RUN"))
    for forbidden in ("apt-get", "pip ", "gcc", "build-essential", "g++", "make"):
        assert forbidden not in runs, f"the final stage runs {forbidden!r}"
    copies = final.all("COPY")
    assert copies == ["--from=builder /opt/venv /opt/venv"]


def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile) -> None:
    _, _, final = dockerfile
    users = final.all("USER")
    assert users, "no USER in the final stage"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "Kubernetes' runAsNonRoot needs a numeric non-root uid"
    assert gid.isdigit() and int(gid) != 0


def test_final_stage_exposes_http_and_grpc_and_checks_healthz(dockerfile) -> None:
    _, _, final = dockerfile
    exposed = {p for line in final.all("EXPOSE") for p in line.split()}
    assert exposed == {"8000", "50051"}
    env = " ".join(final.all("ENV"))
    assert "ADV_HTTP_PORT=8000" in env and "ADV_GRPC_PORT=50051" in env
    assert "ADV_HOST=0.0.0.0" in env, "a container must listen on every interface"
    (healthcheck,) = final.all("HEALTHCHECK")
    assert "/healthz" in healthcheck and "CMD" in healthcheck


def test_entrypoint_is_the_console_script_pyproject_declares(dockerfile) -> None:
    _, _, final = dockerfile
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entrypoint,) = final.all("ENTRYPOINT")
    (cmd,) = final.all("CMD")
    assert json.loads(entrypoint)[0] in scripts
    assert json.loads(cmd) == ["serve"]


def test_every_adv_variable_the_image_sets_is_a_setting() -> None:
    names = set(re.findall(r"\b(ADV_[A-Z_]+)=", DOCKERFILE.read_text()))
    assert names
    fields = {f"ADV_{name.upper()}" for name in Settings.model_fields}
    assert names <= fields, f"not settings: {sorted(names - fields)}"


def _copied_sources(stage: Stage) -> list[str]:
    sources = []
    for args in stage.all("COPY"):
        if args.startswith("--from="):
            continue
        *srcs, _dest = args.split()
        sources.extend(srcs)
    return sources


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops ``path`` (no ! exceptions are used in it)."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        globs = [pattern, pattern.removeprefix("**/")]
        if any(fnmatch.fnmatch(p, g) for p in prefixes for g in globs):
            return True
    return False


def test_dockerignore_keeps_what_the_builder_copies_and_drops_local_state(dockerfile) -> None:
    _, stages, _ = dockerfile
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "_ignored does not handle exceptions"
    for source in _copied_sources(stages["builder"]):
        assert (ROOT / source).exists(), f"the builder copies {source}, which does not exist"
        assert not _ignored(source, patterns), f".dockerignore drops {source}"
    for local in (
        ".git",
        ".venv",
        "tests",
        ".pytest_cache",
        "service/x/__pycache__",
        "clients/node",
        "clients/python/.mypy_cache",
        "clients/python/advantage_client.egg-info",
    ):
        assert _ignored(local, patterns), f".dockerignore keeps {local}"


@pytest.mark.integration
def test_the_files_the_builder_copies_build_the_client_and_service_wheels(
    dockerfile, tmp_path: Path
) -> None:
    """``pip install ./clients/python`` and ``pip install .`` in the builder see only the COPY'd
    files: build both wheels from a copy of exactly those and check they carry the packages
    (the client with the generated gRPC modules the service imports) and the console script."""
    _, stages, _ = dockerfile
    context = tmp_path / "context"
    context.mkdir()
    ignore = shutil.ignore_patterns(
        "__pycache__", "*.pyc", "*.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache"
    )
    for source in _copied_sources(stages["builder"]):
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=ignore)
        else:
            shutil.copy2(src, context / source)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    for project in (context / "clients" / "python", context):
        result = subprocess.run(
            [*pip_wheel, "-q", "-w", str(tmp_path / "dist"), str(project)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    (client_wheel,) = (tmp_path / "dist").glob("advantage_client-*.whl")
    with zipfile.ZipFile(client_wheel) as archive:
        client_names = archive.namelist()
    # (the contract the service reads ships in the client's distribution)
    for module in (
        "advantage_contract/fields.py",
        "advantage_contract/flat.py",
        "advantage_contract/grpc_gen/advantage_pb2.py",
        "advantage_contract/grpc_gen/advantage_pb2_grpc.py",
        "advantage_client/http_client.py",
    ):
        assert module in client_names
    (wheel,) = (tmp_path / "dist").glob("advantage_service-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        declared = archive.read(entry_points).decode()
        assert "advantage-service = advantage_service.cli:main" in declared
        assert "inprocess = advantage_service.api:InProcess" in declared
    assert "advantage_service/__main__.py" in names
    assert "advantage_service/transports/server.py" in names
    assert not any("grpc_gen" in n for n in names), "the gRPC modules live in the contract only"
