"""verl's ``compute_advantage`` patched: the estimators registered here are given the batch's
token ids, per-token inputs, prompt keys and verl's settings. Both trainers call it (the legacy
trainer's ``fit`` from ``verl.trainer.ppo.ray_trainer``, the v1 trainer from
``verl.trainer.ppo.v1.utils``); on the v1 trainer the prompt keys come from its fetch
(:mod:`.v1`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .common import BATCH_INPUTS, TEACHER_PREFIX, VerlConfigError, _estimator_name
from .estimator import REGISTERED, VerlEstimator
from .prompt_keys import prompt_hashes, uid_names
from .v1 import _V1_STEP


def _prompt_keys(data: Any, fn: VerlEstimator, uids: Any) -> np.ndarray | None:
    """Per row, its group's prompt key (None when the estimator keeps no history)."""
    if not fn.history or fn.prompt_key is None:
        return None
    step = _V1_STEP.get()
    if step is not None and "prompt_keys" in step:
        fetched_uids, fetched_keys = step["prompt_keys"]
        return _keys_of(uid_names(uids), fetched_uids, fetched_keys)
    if fn.prompt_key != "hash":
        values = data.non_tensor_batch.get(fn.prompt_key)
        if values is None:
            raise VerlConfigError(
                f"{fn.name}: prompt_key={fn.prompt_key!r} names no field of the batch's "
                f"non_tensor_batch (it has {sorted(data.non_tensor_batch)})"
            )
        return uid_names(values).astype(object)
    keys_present = set(data.batch.keys())
    if "prompts" not in keys_present:
        raise VerlConfigError(
            f"{fn.name} keeps history per prompt, and the batch has no 'prompts' to hash: name a "
            "non_tensor_batch field with prompt_key"
        )
    prompts = data.batch["prompts"]
    mask = None
    if "attention_mask" in keys_present:
        mask = data.batch["attention_mask"][:, : prompts.shape[1]]
    return prompt_hashes(prompts, uids, mask)


def _reward_components(data: Any, fn: VerlEstimator, config: Any) -> dict[str, Any]:
    """verl's ``gdpo_reward_keys`` -> each row's values: the v1 trainer's fetch took them off
    its rows (:mod:`.v1`); the legacy trainer keeps them in ``non_tensor_batch``, where verl's
    own gdpo reads them."""
    step = _V1_STEP.get()
    if step is not None and "reward_components" in step:
        return dict(step["reward_components"])
    keys = fn.reward_keys(config)
    return {k: data.non_tensor_batch[k] for k in keys if k in data.non_tensor_batch}


def _keys_of(uids: np.ndarray, known_uids: np.ndarray, known_keys: np.ndarray) -> np.ndarray:
    """The prompt key of each of ``uids`` among ``known_uids`` (with their ``known_keys``):
    one sort and one binary search, no loop over rows."""
    order = np.argsort(known_uids, kind="stable")
    ordered = known_uids[order]
    at = np.minimum(np.searchsorted(ordered, uids), max(ordered.size - 1, 0))
    found = ordered[at] == uids if ordered.size else np.zeros(uids.size, bool)
    if not bool(found.all()):
        missing = str(uids[int(np.flatnonzero(~found)[0])])
        raise VerlConfigError(f"uid {missing!r} was not fetched with its prompt")
    return np.asarray(known_keys, dtype=object)[order[at]]


def patched_compute_advantage(original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``compute_advantage`` with the estimators registered here given the batch's
    token ids, per-token inputs, prompt keys and verl's settings; every other estimator is
    ``original``'s."""

    def compute_advantage(
        data: Any,
        adv_estimator: Any,
        gamma: float = 1.0,
        lam: float = 1.0,
        num_repeat: int = 1,
        norm_adv_by_std_in_grpo: bool = True,
        config: Any = None,
    ) -> Any:
        fn = REGISTERED.get(_estimator_name(adv_estimator))
        if fn is None:
            return original(
                data,
                adv_estimator=adv_estimator,
                gamma=gamma,
                lam=lam,
                num_repeat=num_repeat,
                norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                config=config,
            )
        if float(gamma) != 1.0 or float(lam) != 1.0:
            fn.estimator_for({"gamma": gamma, "lam": lam})  # (raises, naming the settings)
        batch = data.batch
        keys = set(batch.keys())
        if "response_mask" not in keys:
            from verl.trainer.ppo.ray_trainer import compute_response_mask

            batch["response_mask"] = compute_response_mask(data)
        uids = data.non_tensor_batch.get("uid")
        kwargs: dict[str, Any] = {
            "token_level_rewards": batch["token_level_rewards"],
            "response_mask": batch["response_mask"],
            "index": uids,
            "config": config,
            "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
            "prompt_keys": None if uids is None else _prompt_keys(data, fn, uids),
        }
        if "responses" in keys:
            kwargs["responses"] = batch["responses"]
        for key in BATCH_INPUTS:
            if key in keys:
                kwargs[key] = batch[key]
        teachers = {
            key[len(TEACHER_PREFIX) :]: batch[key]
            for key in keys
            if isinstance(key, str) and key.startswith(TEACHER_PREFIX)
        }
        if teachers:
            kwargs["teacher_log_probs"] = teachers
        if fn.gdpo:
            kwargs["reward_components"] = _reward_components(data, fn, config)
        advantages, returns = fn(**kwargs)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return data

    compute_advantage.__wrapped__ = original  # type: ignore[attr-defined]
    return compute_advantage
