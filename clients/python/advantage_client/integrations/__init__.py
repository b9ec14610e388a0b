"""Trainer integrations: thin adapters from a trainer library onto ``compute_padded``.

- :mod:`.verl`: the service's estimators as verl advantage estimators (``adv_<preset>``), and a
  patched ``compute_advantage`` that passes them the token ids and per-token inputs.
- :mod:`.trl`: a ``GRPOTrainer`` that trains on the service's per-token advantages.

Each imports its trainer library only when used, so this package imports without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from advantage_contract.backend import Backend, inprocess
from advantage_contract.methods import INPUT_READERS, OUTCOMES, TERMS

# The methods and the inputs each reads come from the service's registry, generated into the
# client package (methods.py), so a new method is added in one place.
KNOWN_COMPONENTS = frozenset((*OUTCOMES, *TERMS))
TOP_LEVEL = frozenset(("outcome", "whiten", "clip"))


def components(resolved: Mapping[str, Any]) -> set[str]:
    """The outcome's name and the enabled terms of an estimator object."""
    outcome = resolved.get("outcome", "grpo")
    name = outcome if isinstance(outcome, str) else (outcome or {}).get("name", "grpo")
    terms = {k for k, v in resolved.items() if k not in TOP_LEVEL and v not in (None, False)}
    return {str(name), *terms}


def inputs_read(resolved: Mapping[str, Any]) -> set[str]:
    """The inputs an estimator object reads, from the methods table this client was released
    with (without asking a service: :func:`.checks.inputs_read` reads a service's listing);
    all of them for a component this client does not know (an input too many is only slower)."""
    parts = components(resolved)
    if parts - KNOWN_COMPONENTS:
        return set(INPUT_READERS)
    return {name for name, readers in INPUT_READERS.items() if parts & set(readers)}


def backend(transport: str, url: str | None, client_options: Mapping[str, Any]) -> Backend:
    """The backend of a transport: ``inprocess`` (the service library in this process, torch in
    and out, found through the contract's entry point: this package never imports the
    service), ``http`` or ``grpc`` (a client of a running service at ``url``). Each has the same
    ``compute_padded`` and ``list_estimators``."""
    if transport == "inprocess":
        return inprocess()
    if transport not in ("http", "grpc"):
        raise ValueError(f"transport must be 'inprocess', 'http' or 'grpc', got {transport!r}")
    if url is None:
        raise ValueError(f"transport {transport!r} needs url (the service's address)")
    if transport == "http":
        from ..http_client import HttpClient

        return HttpClient(url, **client_options)
    from ..grpc_client import GrpcClient

    return GrpcClient(url, **client_options)
