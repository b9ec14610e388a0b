"""The client distribution on its own, as a trainer installs it (``pip install clients/python``
in a clean virtual environment, without the service): both of its packages import, the
contract is there, the in-process transport says what to install, and nothing of the service
comes along."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHECK = """
import json, sys
import advantage_client, advantage_contract
from advantage_contract import CONTRACT_VERSION
from advantage_contract.fields import TOKEN_FIELDS
from advantage_client.integrations import backend
try:
    backend("inprocess", None, {})
    inprocess = "no error"
except ModuleNotFoundError as exc:
    inprocess = str(exc)
from advantage_client import HttpClient
import importlib.util
print(json.dumps({
    "contract": CONTRACT_VERSION,
    "fields": list(TOKEN_FIELDS),
    "inprocess": inprocess,
    "service": importlib.util.find_spec("advantage_service") is not None,
    "torch": importlib.util.find_spec("torch") is not None,
}))
"""


def test_the_client_installs_and_imports_without_the_service(tmp_path: Path) -> None:
    # (built from a copy: a build leaves build/ and egg-info beside the sources)
    source = tmp_path / "client"
    shutil.copytree(
        ROOT / "clients" / "python",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".mypy_cache"),
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    out = subprocess.run(
        [str(python), "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout)
    from advantage_contract import CONTRACT_VERSION
    from advantage_contract.fields import TOKEN_FIELDS

    assert found["contract"] == CONTRACT_VERSION
    assert found["fields"] == list(TOKEN_FIELDS)
    assert "pip install advantage-service" in found["inprocess"]
    assert not found["service"] and not found["torch"]
    assert sys.prefix != str(env_dir)
