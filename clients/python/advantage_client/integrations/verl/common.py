"""What the verl integration's modules share: the batch keys it reads, the setup hook's name,
its configuration error, and how it reads verl's settings."""

from __future__ import annotations

from enum import Enum
from typing import Any

HOOK = "advantage_client.integrations.verl.setup"
# data.batch key -> compute_padded keyword (entropys: legacy trainer; entropy: v1 trainer)
BATCH_INPUTS = {
    "old_log_probs": "logprobs",
    "entropys": "entropy",
    "entropy": "entropy",
    "sum_pi_squared": "sum_pi_squared",
    "rollout_is_weights": "is_weights",
    "planning_mask": "planning_mask",
}
TEACHER_PREFIX = "teacher_log_probs."
# Keywords the patched compute_advantage adds to verl's call of a registered estimator.
EXTRA_KWARGS = (
    "responses",
    "teacher_log_probs",
    "prompt_keys",
    "norm_adv_by_std_in_grpo",
    "reward_components",
)


class VerlConfigError(ValueError):
    """A verl setting the service's estimator cannot honour, or an input verl does not give."""


def _setting(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if hasattr(config, "get"):
        try:
            return config.get(key, default)
        except (AttributeError, KeyError, TypeError):
            pass
    return getattr(config, key, default)


def _estimator_name(adv_estimator: Any) -> str:
    return str(adv_estimator.value if isinstance(adv_estimator, Enum) else adv_estimator)
