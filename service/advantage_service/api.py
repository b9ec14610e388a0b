"""The in-process Python API: the same numbers as the server, without a server.

``compute`` lives with the engine's computation (``serving/compute.py``), so the server and this
API share one code path; this module is where users have always imported it from.
"""

from __future__ import annotations

from .serving.compute import compute

__all__ = ["compute"]
