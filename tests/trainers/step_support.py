"""What every trainer's step script (run inside the trainer's own environment) shares: the same
cases run once per transport, chosen through the adapter's ``ADVANTAGE_<TRAINER>_*`` variables
as the trainer's workers would read them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def each_transport(
    adapter: Any, transports: list[list[Any]], run_cases: Callable[[Any], Any], cases: Any
) -> dict[str, Any]:
    """``run_cases(cases)`` per ``[transport, url or None]``, by transport, with the adapter's
    transport and URL variables set to it (the URL's removed where there is none)."""
    out: dict[str, Any] = {}
    for transport, url in transports:
        os.environ[adapter.ENV_TRANSPORT] = transport
        os.environ.pop(adapter.ENV_URL, None)
        if url is not None:
            os.environ[adapter.ENV_URL] = url
        out[transport] = run_cases(cases)
    return out
