"""The v1 trainer (verl 0.9's default), whose advantage step fetches only a few fields from its
transfer queue: that fetch made to also bring the fields the estimator reads (``responses``, the
prompts for the prompt key, ...), while the step's estimator is known (:data:`_V1_STEP`)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import Any

from .common import BATCH_INPUTS, TEACHER_PREFIX, _estimator_name
from .estimator import REGISTERED, VerlEstimator
from .prompt_keys import prompt_hashes, uid_names

# The v1 trainer's advantage step in progress: its estimator and what the fetch brought.
_V1_STEP: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "advantage_verl_v1_step", default=None
)


# What verl 0.9's v1 advantage step has without asking: the fields it fetches itself
# (trainer_base._compute_advantage) and the rollout-correction weights it computes before the
# estimator runs. ("entropys" is the legacy trainer's name; the v1 trainer stores "entropy".)
V1_STEP_HAS = frozenset(
    (
        "uid",
        "response_mask",
        "rm_scores",
        "rollout_log_probs",
        "old_log_probs",
        "ref_log_prob",
        "values",
        "rollout_is_weights",
    )
)


def v1_fields(fn: VerlEstimator, reward_keys: Sequence[str] = ()) -> list[str]:
    """The transfer-queue fields the v1 advantage step must also fetch for ``fn`` (and GDPO's
    ``reward_keys``, which the reward step wrote beside ``rm_scores``)."""
    fields = ["responses"] if fn.token_ids else []
    fields += [
        key
        for key, name in BATCH_INPUTS.items()
        if name in fn.reads and key not in V1_STEP_HAS and key != "entropys"
    ]
    fields += [
        TEACHER_PREFIX + need.split(".", 1)[1]
        for need in sorted(fn.needs)
        if need.startswith("teacher_logprobs.")
    ]
    if fn.history and fn.prompt_key is not None:
        fields.append("prompts" if fn.prompt_key == "hash" else fn.prompt_key)
    return fields + [k for k in reward_keys if k not in fields]


class _TransferQueueFetch:
    """The v1 trainer's ``transfer_queue`` module as it sees it, with its advantage step's
    fetch (``kv_batch_get`` of uid, response_mask, rm_scores, ...) extended by the fields the
    estimator in progress reads; the prompt keys are taken off the fetched rows. Everything
    else is the module's."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def kv_batch_get(
        self, keys: Any, partition_id: str, select_fields: Any = None
    ) -> Any:  # (verl's call)
        step = _V1_STEP.get()
        advantage_fetch = (
            step is not None
            and isinstance(select_fields, list)
            and "rm_scores" in select_fields
            and "uid" in select_fields
        )
        if not advantage_fetch:
            return self._module.kv_batch_get(
                keys=keys, partition_id=partition_id, select_fields=select_fields
            )
        assert step is not None
        fn: VerlEstimator = step["estimator"]
        reward_keys = step.get("reward_keys", ())
        extra = [f for f in v1_fields(fn, reward_keys) if f not in select_fields]
        data = self._module.kv_batch_get(
            keys=keys, partition_id=partition_id, select_fields=[*select_fields, *extra]
        )
        if fn.history and fn.prompt_key is not None:
            source = "prompts" if fn.prompt_key == "hash" else fn.prompt_key
            values = data.pop(source)
            uids = uid_names(data["uid"])
            if source == "prompts":
                rows = list(values.unbind(0)) if hasattr(values, "unbind") else list(values)
                keys_per_row = prompt_hashes(rows, uids)
            else:
                keys_per_row = uid_names(values).astype(object)
            step["prompt_keys"] = (uids, keys_per_row)
        if reward_keys:  # (per row, in the fetched rows' order: the rows the estimator gets)
            step["reward_components"] = {
                key: values.tolist() if hasattr(values, "tolist") else list(values)
                for key in reward_keys
                if (values := data.pop(key, None)) is not None
            }
        return data


def _v1_compute_advantage(original: Callable[..., Any]) -> Callable[..., Any]:
    """The v1 trainer's ``_compute_advantage`` with the step's estimator known to the fetch."""

    def _compute_advantage(self: Any, batch: Any, metrics: dict[str, Any]) -> Any:
        fn = REGISTERED.get(_estimator_name(self.config.algorithm.adv_estimator))
        if fn is None:
            return original(self, batch, metrics)
        step: dict[str, Any] = {"estimator": fn}
        if fn.gdpo:
            step["reward_keys"] = fn.reward_keys(self.config.algorithm)
        token = _V1_STEP.set(step)
        try:
            return original(self, batch, metrics)
        finally:
            _V1_STEP.reset(token)

    _compute_advantage.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_advantage
