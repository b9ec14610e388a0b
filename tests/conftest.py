"""Shared test setup: the tests directory is importable (for the oracle and helpers)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
