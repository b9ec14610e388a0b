"""The README's quick start works as written: its curl command against a real server, its
`compute` pipeline and its Python snippet, each giving the numbers the README says."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from http_support import Server

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
QUICK_START = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", QUICK_START, flags=re.S)


def block(language: str, containing: str) -> str:
    return next(code for lang, code in BLOCKS if lang == language and containing in code)


@pytest.mark.integration
def test_the_quick_start_curl_command_answers_what_the_readme_says(server: Server) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    command = block("sh", "curl").replace("localhost:8000", f"127.0.0.1:{server.port}")
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rollouts = json.loads(out.stdout)["groups"][0]["rollouts"]
    assert rollouts[0]["advantages"] == [0.70710576] * 3 and rollouts[0]["scalar"] == 0.70710576
    assert rollouts[1]["advantages"] == [-0.70710576] * 2
    assert "**0.7071**" in QUICK_START and "**-0.7071**" in QUICK_START


def test_the_quick_start_compute_pipeline_runs_as_written() -> None:
    command = block("sh", "advantage-service compute").replace(
        ".venv/bin/advantage-service", f"{sys.executable} -m advantage_service"
    )
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rollouts = json.loads(out.stdout)["groups"][0]["rollouts"]
    assert rollouts[0]["advantages"] == [0.70710576, 0.70710576]


def test_the_quick_start_python_snippet_runs_as_written_and_prints_its_comment() -> None:
    code = block("python", "import advantage_service")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    first = printed.getvalue().splitlines()[0]
    promised = re.search(r"print\(response.*\)  # (.*)", code)
    assert promised is not None

    def values(text: str) -> list[float]:
        return [float(v) for v in text.strip("[] ").split()]

    assert values(first) == values(promised.group(1))
