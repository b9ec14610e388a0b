"""verl (0.9.x): the service's estimators as verl advantage estimators.

::

    from advantage_client.integrations import verl as adv_verl

    adv_verl.register()            # adv_grpo, adv_ktae, ... in-process; or
    adv_verl.register("http", "http://advantage:8000", ignore_token_ids=[151643])
    adv_verl.patch()               # compute_advantage passes token ids and per-token inputs
    # then algorithm.adv_estimator=adv_ktae

:func:`register` adds each preset as ``adv_<preset>`` to verl's estimator registry
(``core_algos.register_adv_est``). verl calls a registered estimator with
``token_level_rewards``, ``response_mask``, ``index`` (the uids) and ``config`` only, which is
all an outcome estimator (``adv_grpo``, ``adv_rloo``, ...) needs; the per-row rewards are
``token_level_rewards.sum(-1)`` as in verl's own outcome estimators, and ``returns`` are the
advantages. A token-level estimator (``adv_ktae``, ``adv_cscr``, ``adv_opsd``, ``adv_otb``,
``adv_forking``, ``adv_gtpo``, ``adv_grpo_s``, ``adv_hicra``) also needs the token ids and
per-token inputs: :func:`patch` replaces ``verl.trainer.ppo.ray_trainer.compute_advantage``
(and the name the v1 trainer's ``verl.trainer.ppo.v1.utils`` imported, when that module
imports) with one that, for the estimators registered here, passes from ``data.batch``:

=========================== ==========================================================
``data.batch`` key          sent as
=========================== ==========================================================
``responses``               the token ids (B, T)
``old_log_probs``           ``logprobs`` (OPSD, OTB)
``entropys``                ``entropy`` (forking tokens, GTPO, GRPO-S)
``sum_pi_squared``          ``sum_pi_squared`` (OTB)
``rollout_is_weights``      ``is_weights`` (OTB, when present)
``planning_mask``           ``planning_mask`` (HICRA, when present: else the service's
                            tokenizer finds planning tokens, when it has one)
``teacher_log_probs.<c>``   ``teacher_logprobs[<c>]`` (CSCR's pos/neg, OPSD's teacher)
=========================== ==========================================================

Each input is sent only to an estimator that reads it. Every other estimator name goes to
verl's own ``compute_advantage`` unchanged. verl is imported when these functions are called,
not when this module is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np

from . import backend, inputs_read

PREFIX = "adv_"
# data.batch key -> compute_padded keyword
BATCH_INPUTS = {
    "old_log_probs": "logprobs",
    "entropys": "entropy",
    "sum_pi_squared": "sum_pi_squared",
    "rollout_is_weights": "is_weights",
    "planning_mask": "planning_mask",
}
TEACHER_PREFIX = "teacher_log_probs."
# Keywords the patched compute_advantage adds to verl's call of a registered estimator.
EXTRA_KWARGS = ("responses", "teacher_log_probs", *BATCH_INPUTS)

# Names registered here -> their estimator functions (what patch() routes).
REGISTERED: dict[str, Callable[..., tuple[Any, Any]]] = {}
# Module -> the compute_advantage patch() replaced there.
_ORIGINALS: dict[Any, Callable[..., Any]] = {}


def _to_torch(values: Any, like: Any) -> Any:
    import torch

    if isinstance(values, torch.Tensor):
        return values.to(like.device)
    return torch.from_numpy(np.asarray(values)).to(like.device)


def make_estimator(
    name: str,
    estimator: Any,
    compute_padded: Callable[..., Any],
    reads: set[str],
    *,
    ignore_token_ids: Sequence[int] | None = None,
    namespace: str | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """A verl advantage estimator (the ``register_adv_est`` signature, plus the keywords
    :func:`patch` adds) computing ``estimator`` through ``compute_padded``."""
    from ..padded import needs_token_ids

    token_ids = needs_token_ids(estimator) or bool(reads)

    def estimate(
        token_level_rewards: Any,
        response_mask: Any,
        index: Any = None,
        config: Any = None,
        responses: Any = None,
        teacher_log_probs: Mapping[str, Any] | None = None,
        **inputs: Any,
    ) -> tuple[Any, Any]:
        if index is None:
            raise ValueError(f"{name} needs the prompt uids (data.non_tensor_batch['uid'])")
        if token_ids and responses is None:
            raise ValueError(
                f"{name} needs the response token ids: call "
                "advantage_client.integrations.verl.patch() so that compute_advantage passes "
                "data.batch['responses']"
            )
        per_token = {
            BATCH_INPUTS[key]: value
            for key, value in inputs.items()
            if key in BATCH_INPUTS and value is not None and BATCH_INPUTS[key] in reads
        }
        teachers = dict(teacher_log_probs or {}) if "teacher_logprobs" in reads else None
        rewards = token_level_rewards.sum(dim=-1)
        result = compute_padded(
            responses if token_ids else None,
            response_mask,
            rewards,
            index,
            estimator=estimator,
            teacher_logprobs=teachers,
            ignore_token_ids=ignore_token_ids,
            namespace=namespace,
            **per_token,
        )
        advantages = _to_torch(result.advantages, token_level_rewards)
        return advantages, advantages

    estimate.__name__ = f"compute_{name}_advantage"
    estimate.__doc__ = f"advantage-service estimator {estimator!r} as verl estimator {name!r}."
    return estimate


def register(
    transport: str = "inprocess",
    url: str | None = None,
    presets: Sequence[str] | Mapping[str, Any] | None = None,
    **client_options: Any,
) -> dict[str, Callable[..., tuple[Any, Any]]]:
    """Register the service's estimators with verl as ``adv_<name>``; returns them by name.

    ``transport``: ``inprocess`` (the ``advantage_service`` library in the trainer's process:
    torch tensors in and out, on their device), ``http`` (Arrow) or ``grpc`` to a service at
    ``url``. ``presets``: preset names (default: every preset the service has) or a mapping
    ``{name: estimator}`` of estimator objects (or preset names) under names of your choice.
    ``client_options``: ``ignore_token_ids`` and ``namespace`` for every call, the rest for
    the client (``timeout``, ``token``, ...). Registering a name again replaces it.
    """
    from verl.trainer.ppo import core_algos

    ignore_token_ids = client_options.pop("ignore_token_ids", None)
    namespace = client_options.pop("namespace", None)
    compute_padded, known_presets, _ = backend(transport, url, client_options)
    resolved = known_presets()
    chosen: dict[str, Any]
    if presets is None:
        chosen = {name: name for name in resolved}
    elif isinstance(presets, Mapping):
        chosen = dict(presets)
    else:
        chosen = {name: name for name in presets}
    registered = {}
    for name, estimator in chosen.items():
        full = resolved.get(estimator) if isinstance(estimator, str) else estimator
        if isinstance(estimator, str) and full is None:
            raise ValueError(f"unknown preset {estimator!r}; presets: {sorted(resolved)}")
        verl_name = name if name.startswith(PREFIX) else PREFIX + name
        fn = make_estimator(
            verl_name,
            estimator,
            compute_padded,
            inputs_read(full or {}),
            ignore_token_ids=ignore_token_ids,
            namespace=namespace,
        )
        # register_adv_est refuses a different function under a taken name: replace ours.
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(verl_name, None)
        core_algos.register_adv_est(verl_name)(fn)
        REGISTERED[verl_name] = fn
        registered[verl_name] = fn
    return registered


def _estimator_name(adv_estimator: Any) -> str:
    return str(adv_estimator.value if isinstance(adv_estimator, Enum) else adv_estimator)


def patched_compute_advantage(original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``compute_advantage`` with the estimators registered here given the batch's
    token ids and per-token inputs; every other estimator is ``original``'s."""

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
        batch = data.batch
        keys = set(batch.keys())
        if "response_mask" not in keys:
            from verl.trainer.ppo.ray_trainer import compute_response_mask

            batch["response_mask"] = compute_response_mask(data)
        kwargs: dict[str, Any] = {
            "token_level_rewards": batch["token_level_rewards"],
            "response_mask": batch["response_mask"],
            "index": data.non_tensor_batch.get("uid"),
            "config": config,
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
        advantages, returns = fn(**kwargs)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return data

    compute_advantage.__wrapped__ = original  # type: ignore[attr-defined]
    return compute_advantage


def patch() -> list[str]:
    """Make verl's ``compute_advantage`` pass the estimators registered here what they need
    from ``data.batch``; returns the modules patched. Idempotent; :func:`unpatch` undoes it.

    Patched: ``verl.trainer.ppo.ray_trainer`` (the trainer's ``fit`` looks the name up there)
    and, when it imports, ``verl.trainer.ppo.v1.utils`` (the v1 trainer imports the function
    by name). The v1 trainer fetches only ``uid``, ``response_mask``, ``rm_scores``, log-probs
    and values from its transfer queue for the advantage step, not ``responses``, so there only
    the outcome estimators (``adv_grpo``, ...) work unless its field list is extended.
    """
    import importlib

    patched = []
    for name in ("verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.utils"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            if name.endswith("ray_trainer"):
                raise
            continue  # the v1 trainer needs transfer_queue
        current = getattr(module, "compute_advantage")  # noqa: B009  (verl is untyped)
        if module not in _ORIGINALS:
            _ORIGINALS[module] = current
            setattr(module, "compute_advantage", patched_compute_advantage(current))  # noqa: B010
        patched.append(name)
    return patched


def unpatch() -> None:
    """Put back the ``compute_advantage`` functions :func:`patch` replaced."""
    for module, original in list(_ORIGINALS.items()):
        setattr(module, "compute_advantage", original)  # noqa: B010
        del _ORIGINALS[module]
