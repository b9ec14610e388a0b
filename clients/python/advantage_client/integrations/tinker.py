"""Tinker (the ``tinker`` SDK 0.38): per-token ``advantages`` filled into the ``loss_fn_inputs``
of a batch of ``tinker.types.Datum``, as the cookbook's ``importance_sampling`` and ``ppo``
losses take them.

::

    from advantage_client.integrations.tinker import TinkerAdvantages

    advantages = TinkerAdvantages({"outcome": "grpo", "ktae": {"history": "prompt"}},
                                  transport="http", url="http://advantage:8000")
    # the cookbook's data, metadata = assemble_training_data(groups, compute_advantages(groups))
    data = advantages.fill(data, rewards, group_ids)   # instead of compute_advantages
    training_client.forward_backward(data, loss_fn="importance_sampling")

Each datum is one rollout: its ``target_tokens`` are the token ids, the rollout's own tokens are
where its ``loss_fn_inputs["mask"]`` is 1 (the cookbook's mask; ``weights`` when it has none;
observation tokens are 0 and keep advantage 0, as in the cookbook), ``logprobs`` are the
sampled log-probs (read by the estimators that need them). ``rewards`` and ``group_ids`` give one
reward and one group per datum (the cookbook's ``metadata[i]["group_idx"]``). The prompt key for
history is the contract's hash of the tokens before the rollout's first own token; pass
``prompt_keys`` where the model input holds images.

The estimator is checked against the service's listing when this is built.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from advantage_contract.prompt_keys import prompt_key

from . import backend
from .checks import EstimatorCheckError, inputs_read, required_inputs, resolve, uses_history

DEFAULT_RETRY_FOR = 60.0
# Where a datum's own (sampled) tokens are marked, in order of preference.
MASK_FIELDS = ("mask", "weights")
# The inputs a datum carries (compute_padded keyword -> loss_fn_inputs key).
DATUM_INPUTS = {"logprobs": "logprobs"}


class TinkerInputError(ValueError):
    """A datum, reward or group the service's estimator cannot take, naming the datum and the
    field."""


class TinkerAdvantages:
    """One estimator of the service for Tinker's data: :meth:`fill` returns the datums with
    their ``advantages``.

    ``estimator``: a preset name or an estimator object. ``transport``: ``inprocess`` (the
    service library in this process), ``http`` or ``grpc`` (then ``url``). ``options``:
    ``ignore_token_ids`` and ``namespace`` for every call, ``retry_for`` (seconds, default 60)
    and the rest for the client (``timeout``, ``token``, ...).
    """

    def __init__(
        self,
        estimator: Any = "grpo",
        *,
        transport: str | None = None,
        url: str | None = None,
        **options: Any,
    ) -> None:
        transport = transport or ("http" if url else "inprocess")
        self.ignore_token_ids = options.pop("ignore_token_ids", None)
        self.namespace = options.pop("namespace", None)
        if transport != "inprocess":
            options.setdefault("retry_for", DEFAULT_RETRY_FOR)
        self.backend = backend(transport, url, options)
        listing = self.backend.list_estimators()
        try:
            self.resolved = resolve(listing, estimator)
        except EstimatorCheckError as exc:
            raise TinkerInputError(f"estimator {estimator!r}: {exc}") from None
        self.estimator = estimator
        self.needs = required_inputs(listing, self.resolved)
        missing = sorted(self.needs - set(DATUM_INPUTS))
        if missing:
            raise TinkerInputError(
                f"estimator {estimator!r} needs {missing}, which a Tinker datum does not carry "
                f"(it gives the target tokens and {sorted(DATUM_INPUTS)})"
            )
        self.reads = inputs_read(listing, self.resolved)
        self.history = uses_history(self.resolved)
        self._request_prefix = uuid.uuid4().hex
        self._calls = itertools.count()

    def fill(
        self,
        data: Sequence[Any],
        rewards: Sequence[float],
        group_ids: Sequence[Any],
        *,
        prompt_keys: Sequence[str | None] | None = None,
    ) -> list[Any]:
        """The datums with ``loss_fn_inputs["advantages"]`` (float32, the length of their
        ``target_tokens``) from the service; every other field kept."""
        from tinker import TensorData

        count = len(data)
        for name, values in (("rewards", rewards), ("group_ids", group_ids)):
            if len(values) != count:
                raise TinkerInputError(f"{name} has {len(values)} entries for {count} datums")
        if prompt_keys is not None and len(prompt_keys) != count:
            raise TinkerInputError(f"prompt_keys has {len(prompt_keys)} entries for {count} datums")
        rows = [_rollout(datum, i, "logprobs" in self.reads) for i, datum in enumerate(data)]
        width = max([len(tokens) for tokens, _, _ in rows] + [1])
        tokens = np.zeros((count, width), dtype=np.int64)
        mask = np.zeros((count, width), dtype=bool)
        logprobs = np.zeros((count, width)) if "logprobs" in self.reads else None
        for i, (row_tokens, row_mask, row_logprobs) in enumerate(rows):
            tokens[i, : len(row_tokens)] = row_tokens
            mask[i, : len(row_mask)] = row_mask
            if logprobs is not None and row_logprobs is not None:
                logprobs[i, : len(row_logprobs)] = row_logprobs
        groups = np.asarray([str(g) for g in group_ids])
        keys = None
        if self.history:
            keys = prompt_keys if prompt_keys is not None else _prompt_keys(data, rows)
        result = self.backend.compute_padded(
            tokens,
            mask,
            np.asarray(rewards, dtype=np.float64),
            groups,
            estimator=self.resolved,
            logprobs=logprobs,
            ignore_token_ids=self.ignore_token_ids,
            namespace=self.namespace,
            request_id=f"tinker:{self._request_prefix}:{next(self._calls)}",
            prompt_keys=keys,
        )
        advantages = np.asarray(result.advantages, dtype=np.float32)
        out = []
        for i, datum in enumerate(data):
            filled = TensorData.from_numpy(np.ascontiguousarray(advantages[i, : len(rows[i][0])]))
            inputs = {**datum.loss_fn_inputs, "advantages": filled}
            out.append(dataclasses.replace(datum, loss_fn_inputs=inputs))
        return out


def _rollout(
    datum: Any, index: int, with_logprobs: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(target tokens, own-token mask, sampled log-probs) of one datum, checked."""
    inputs = datum.loss_fn_inputs
    if "target_tokens" not in inputs:
        raise TinkerInputError(f"datum {index} has no loss_fn_inputs['target_tokens']")
    tokens = inputs["target_tokens"].to_numpy().reshape(-1).astype(np.int64)
    field = next((f for f in MASK_FIELDS if f in inputs), None)
    if field is None:
        raise TinkerInputError(
            f"datum {index} has neither loss_fn_inputs['mask'] nor ['weights'] to say which of "
            "its tokens it sampled: fill advantages before the cookbook removes the mask"
        )
    mask = inputs[field].to_numpy().reshape(-1)
    if mask.shape != tokens.shape:
        raise TinkerInputError(
            f"datum {index}: loss_fn_inputs['{field}'] has {mask.size} entries for "
            f"{tokens.size} target tokens"
        )
    logprobs = None
    if with_logprobs:
        if "logprobs" not in inputs:
            raise TinkerInputError(f"datum {index} has no loss_fn_inputs['logprobs']")
        logprobs = inputs["logprobs"].to_numpy().reshape(-1).astype(np.float64)
        if logprobs.shape != tokens.shape:
            raise TinkerInputError(
                f"datum {index}: loss_fn_inputs['logprobs'] has {logprobs.size} entries for "
                f"{tokens.size} target tokens"
            )
    return tokens, mask > 0, logprobs


def _prompt_keys(data: Sequence[Any], rows: list[tuple[np.ndarray, np.ndarray, Any]]) -> list[str]:
    """Per datum, the contract's hash of its prompt: the input tokens up to and including the
    one that predicts its first own token (target i is input i + 1)."""
    keys: list[str] = []
    for i, datum in enumerate(data):
        own = np.flatnonzero(rows[i][1])
        try:
            ids = datum.model_input.to_ints()
        except Exception as exc:  # (an image chunk has no token ids)
            raise TinkerInputError(
                f"datum {i}: its model_input is not all tokens ({exc}); pass prompt_keys"
            ) from None
        keys.append(prompt_key(ids[: int(own[0]) + 1] if own.size else ids))
    return keys
