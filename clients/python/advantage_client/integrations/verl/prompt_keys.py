"""Prompt keys: verl's uid is a fresh uuid4 per step, so history keyed by it never applies; an
estimator with history keys each group by the contract's key of its prompt's token ids instead
(:func:`advantage_contract.prompt_keys.prompt_key`, the key every integration sends, so history
carries across trainers in a namespace)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from advantage_contract.prompt_keys import prompt_key


def uid_names(uids: Any) -> np.ndarray:
    """The uids as strings (B,), ``str()`` of each element in numpy's C loop: the uids that
    print the same are one group, as ``compute_padded`` groups them."""
    values = uids.tolist() if hasattr(uids, "tolist") and not isinstance(uids, np.ndarray) else uids
    names = np.asarray(values)
    if names.dtype.kind != "U":
        names = np.asarray(values, dtype=object).astype(str)
    return names.reshape(-1)


def prompt_hashes(prompts: Sequence[Any], uids: Any, mask: Any = None) -> np.ndarray:
    """Per row, a key of its prompt: a hash of the token ids of its group's first row, one
    hash per uid (the uids mapped once, by numpy). ``prompts``: per row its prompt's token
    ids, a (B, P) array or a sequence of rows; ``mask`` (B, P), when given, marks each row's
    prompt tokens (padding removed from the rows hashed, and only from those)."""
    _, first, inverse = np.unique(uid_names(uids), return_index=True, return_inverse=True)
    keys = []
    # One key per distinct prompt (the contract's: a hash computed by numpy would move every
    # stored prompt's history, and differ from the other trainers').
    for row in first.tolist():
        ids = _as_numpy(prompts[row])
        if mask is not None:
            ids = ids[_as_numpy(mask[row]).astype(bool)]
        keys.append(prompt_key(ids))
    return np.asarray(keys, dtype=object)[inverse.reshape(-1)]


def _as_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)
