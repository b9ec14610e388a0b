"""The key a prompt's history is stored under, one for every trainer integration.

History (KTAE's ``history: "prompt"``, ...) is kept per namespace and prompt key, so a prompt
must get the same key whichever trainer sends it: the same token ids, the same key, in every
process, run and integration (TRL, verl, and the adapters built on this contract).

:func:`prompt_key`: ``"p:"`` and the blake2b-128 hex digest of the prompt's token ids (padding
removed) as little-endian int64. verl's integration has always used this key, so its stored
history keeps applying. TRL's integration used the blake2b-96 digest without the prefix
(:func:`legacy_prompt_key`, scheme ``"trl-0.1"``): a run that started before keeps reading its
history with ``advantage_options={"prompt_key_scheme": "trl-0.1"}`` until it ends; a new run
uses the contract's key (its history starts afresh, and is shared with every other trainer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

PREFIX = "p:"
CONTRACT = "contract"
# The scheme of the TRL integration of client 0.1 (before the one key).
TRL_LEGACY = "trl-0.1"


def _id_bytes(token_ids: Any) -> bytes:
    if hasattr(token_ids, "detach"):  # (a torch tensor, without importing torch)
        token_ids = token_ids.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(token_ids).reshape(-1), dtype="<i8").tobytes()


def prompt_key(token_ids: Any) -> str:
    """The contract's key of a prompt: ``"p:"`` + blake2b-128 of its token ids (int64,
    little-endian), padding already removed by the caller."""
    return PREFIX + hashlib.blake2b(_id_bytes(token_ids), digest_size=16).hexdigest()


def legacy_prompt_key(token_ids: Any) -> str:
    """The TRL integration's key before the contract's (client 0.1): blake2b-96, no prefix."""
    return hashlib.blake2b(_id_bytes(token_ids), digest_size=12).hexdigest()


SCHEMES: dict[str, Callable[[Any], str]] = {CONTRACT: prompt_key, TRL_LEGACY: legacy_prompt_key}


def key_function(scheme: str | None) -> Callable[[Any], str]:
    """The key function of a scheme name (None: the contract's); an unknown name is refused,
    naming the known ones."""
    name = CONTRACT if scheme is None else scheme
    if name not in SCHEMES:
        raise ValueError(f"prompt_key_scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
    return SCHEMES[name]
