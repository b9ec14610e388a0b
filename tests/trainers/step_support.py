"""What every trainer's step script (run inside the trainer's own environment) shares: the same
cases run once per transport, chosen through the adapter's ``ADVANTAGE_<TRAINER>_*`` variables
as the trainer's workers would read them, what construction says to bad settings, and the one
``RESULT`` line the test reads."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
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


def construction_said(error: type[Exception], build: Callable[..., Any], *args: Any) -> str:
    """What building a patched trainer object (``build(*args)``) says to its settings:
    ``"accepted"``, or the message of the ``error`` it raised."""
    try:
        build(*args)
    except error as exc:
        return str(exc)
    return "accepted"


def print_result(
    package: str,
    adapter: Any,
    run_cases: Callable[[Any], Any],
    refusals: Callable[[], list[str]],
    **extra: Any,
) -> None:
    """A step script's main. argv[1]: a JSON object: ``transports`` (``[name, url or null]``
    each) and ``cases``. Prints ``RESULT <json>``: ``package``'s version, what construction
    said to bad settings (``refusals()``, before any case runs), per transport what
    ``run_cases(cases)`` gave, and ``extra``."""
    config = json.loads(sys.argv[1])
    out: dict[str, Any] = {
        "version": importlib.metadata.version(package),
        "refusals": refusals(),
        **extra,
    }
    out["transports"] = each_transport(adapter, config["transports"], run_cases, config["cases"])
    print("RESULT " + json.dumps(out))
