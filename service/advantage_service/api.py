"""The in-process Python API: the same numbers as the server, without a server.

``compute`` lives with the engine's computation (``serving/compute.py``), so the server and this
API share one code path; this module is where users have always imported it from.
:class:`InProcess` is the contract's backend (``advantage_contract.backend.Backend``) computing in
this process: the integrations find it through the ``advantage_contract.backends`` entry point,
so the client package never imports the service.
"""

from __future__ import annotations

from typing import Any

from .serving.compute import compute
from .wire.padded import compute_padded

__all__ = ["InProcess", "compute"]


class InProcess:
    """The service library as a backend of the padded API (torch tensors in, on their device,
    and out; no stats store: estimators with history keep none)."""

    compute_padded = staticmethod(compute_padded)

    def list_estimators(self) -> dict[str, Any]:
        from .wire.listing import estimator_listing

        return dict(estimator_listing())
