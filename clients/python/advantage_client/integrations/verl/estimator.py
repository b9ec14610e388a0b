"""The service's estimators as verl advantage estimators: :class:`VerlEstimator` (one service
estimator behind ``register_adv_est``'s signature), :func:`make_estimators` (each checked against
the service's listing) and :func:`register` (into verl's registry, as ``adv_<name>``).

Rewards: ``token_level_rewards`` may be spread over tokens (verl's KL penalty in the reward).
Every outcome (and the terms built on it) uses each row's sum, as verl's own outcome estimators
do; OTB uses the reward-to-go of each token, as verl's ``optimal_token_baseline`` does.

GDPO (``adv_gdpo``): verl's ``algorithm.gdpo_reward_keys`` name the reward components, read per
row from ``non_tensor_batch`` (what ``compute_score`` returned in its dict) as verl's own
``gdpo`` reads them, and ``algorithm.gdpo_reward_weights`` their weights; both are sent
(``reward_components``, the outcome's ``weights``) and checked when the trainer is built.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import numpy as np

from advantage_contract.errors import AdvantageError

from .. import adapter, backend
from .common import BATCH_INPUTS, TEACHER_PREFIX, VerlConfigError, _setting

log = logging.getLogger("advantage_client.verl")

PREFIX = "adv_"
# Default total time a call keeps retrying a service that is down (a rolling restart).
DEFAULT_RETRY_FOR = 60.0
# What to set in verl when an input is missing from the batch.
INPUT_HINTS = {
    "logprobs": "data.batch['old_log_probs'] (verl's old-log-prob pass computes it; with "
    "rollout correction's bypass mode it is the rollout's)",
    "sum_pi_squared": "set actor_rollout_ref.actor.calculate_sum_pi_squared=True (legacy trainer, "
    "trainer.use_v1=false: the v1 trainer of verl 0.9 does not compute it)",
    "entropy": "the old-log-prob pass's entropies in data.batch['entropys'] (the legacy trainer "
    "pops them before the advantage step: keep a copy) or data.batch['entropy'] (v1 trainer)",
    "planning_mask": "data.batch['planning_mask'] (1 on planning tokens), or a service started "
    "with --tokenizer (HICRA then finds strategic phrases itself)",
}
# Outcome presets -> verl's own estimator of the same math (the opt-in local fallback).
LOCAL_FALLBACK = {
    "grpo": "grpo_vectorized",
    "dr_grpo": "grpo",
    "rloo": "rloo_vectorized",
    "opo": "opo",
    "gpg": "gpg",
    "reinforce_pp_baseline": "reinforce_plus_plus_baseline",
    "grpo_passk": "grpo_passk",
}
# Errors a fallback covers: the service could not be reached or would not take the call in time.
UNREACHABLE = ("unavailable", "overloaded", "timeout", "saturated", "shutting_down")

# Names registered here -> their estimator functions (what patch() routes).
REGISTERED: dict[str, VerlEstimator] = {}


def _to_torch(values: Any, like: Any) -> Any:
    import torch

    if isinstance(values, torch.Tensor):
        return values.to(like.device)
    return torch.from_numpy(np.asarray(values)).to(like.device)


def reward_to_go(token_level_rewards: Any, response_mask: Any) -> Any:
    """G_t = sum_{j >= t} r_j per row, as verl's optimal_token_baseline computes its returns."""
    masked = token_level_rewards * response_mask
    return masked.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


class VerlEstimator(adapter.RegisteredEstimator):
    """A verl advantage estimator (``register_adv_est``'s signature, plus the keywords
    :func:`patch` adds) computing one service estimator through ``compute_padded``."""

    def __init__(
        self,
        checked: adapter.Checked,
        compute_padded: Callable[..., Any],
        *,
        prompt_key: str | None = "hash",
        fallback: bool = False,
        retry_stats: Any = None,
        **call: Unpack[adapter.CallOptions],
    ) -> None:
        from advantage_contract.padded import needs_token_ids

        super().__init__(checked, **call)
        full = self.full
        self.compute_padded = compute_padded
        self.prompt_key = prompt_key
        self.outcome = str((full.get("outcome") or {}).get("name", "grpo"))
        # (the outcome that reads verl's gdpo_reward_keys from the batch)
        self.gdpo = self.outcome == "gdpo"
        self.token_ids = needs_token_ids(full)
        self.fallback = LOCAL_FALLBACK.get(self.outcome) if fallback else None
        if fallback and (self.fallback is None or self.token_ids or full.get("clip") is not None):
            raise VerlConfigError(
                f"{self.name}: the local fallback covers outcome-only estimators equal to one of "
                f"verl's ({sorted(LOCAL_FALLBACK)}, no terms, no clip); {self.full} is not one: "
                "register it without fallback"
            )
        # Each call's request id (this process's random prefix, the estimator, a count): a call
        # the client retries after its connection was cut, once the service had counted it, is
        # not counted again.
        self._request_prefix = uuid.uuid4().hex
        self._calls = itertools.count()
        self.retry_stats = retry_stats  # (the client's: its retries counted per call)
        self.__name__ = f"compute_{self.name}_advantage"
        self.__doc__ = (
            f"advantage-service estimator {self.given!r} as verl estimator {self.name!r}."
        )

    # ---- verl's settings --------------------------------------------------------------------

    def estimator_for(self, algorithm: Any, norm_adv_by_std_in_grpo: bool | None = None) -> Any:
        """The estimator object to send under verl's algorithm settings: each honoured (the
        outcome's ``norm_by_std`` follows ``norm_adv_by_std_in_grpo``) or refused with an error
        that says what to set."""
        gamma, lam = _setting(algorithm, "gamma", 1.0), _setting(algorithm, "lam", 1.0)
        if float(gamma) != 1.0 or float(lam) != 1.0:
            raise VerlConfigError(
                f"{self.name}: algorithm.gamma={gamma} and algorithm.lam={lam} discount returns "
                "(verl's gae, reinforce_plus_plus); the service's estimators are group baselines "
                "that do not discount, as verl's grpo and rloo: set algorithm.gamma=1.0 and "
                "algorithm.lam=1.0"
            )
        if _setting(algorithm, "use_pf_ppo", False):
            raise VerlConfigError(
                f"{self.name}: algorithm.use_pf_ppo reweights the batch in verl's gae branch only; "
                "set algorithm.use_pf_ppo=false"
            )
        if self.gdpo:
            return self._gdpo_estimator(algorithm)
        if _setting(algorithm, "gdpo_reward_keys", None):
            raise VerlConfigError(
                f"{self.name}: algorithm.gdpo_reward_keys is read by verl's gdpo estimator only; "
                "remove it (or use algorithm.adv_estimator=gdpo)"
            )
        norm = norm_adv_by_std_in_grpo
        if norm is None:
            norm = bool(_setting(algorithm, "norm_adv_by_std_in_grpo", True))
        outcome = dict(self.full["outcome"])
        if "norm_by_std" not in outcome or bool(outcome["norm_by_std"]) == bool(norm):
            return self.full  # (an outcome without the std division has nothing to divide)
        explicit = (
            isinstance(self.given, Mapping)
            and isinstance(self.given.get("outcome"), Mapping)
            and "norm_by_std" in self.given["outcome"]
        )
        if explicit:
            raise VerlConfigError(
                f"{self.name}: its estimator sets norm_by_std={outcome['norm_by_std']} but "
                f"algorithm.norm_adv_by_std_in_grpo={norm}: make them agree"
            )
        return {**self.full, "outcome": {**outcome, "norm_by_std": bool(norm)}}

    def reward_keys(self, algorithm: Any) -> list[str]:
        """verl's ``algorithm.gdpo_reward_keys`` (the GDPO outcome needs them)."""
        keys = _setting(algorithm, "gdpo_reward_keys", None)
        if not keys:
            raise VerlConfigError(
                f"{self.name}: GDPO needs algorithm.gdpo_reward_keys listing the reward "
                "components compute_score returns in its dict (e.g. ['format_reward', "
                "'accuracy_reward']), as verl's own gdpo does"
            )
        return [str(k) for k in keys]

    def _gdpo_estimator(self, algorithm: Any) -> dict[str, Any]:
        """The GDPO estimator with verl's ``gdpo_reward_weights`` as its ``weights`` (verl's
        default: 1 each); weights the estimator sets itself must agree with verl's."""
        keys = self.reward_keys(algorithm)
        weights = _setting(algorithm, "gdpo_reward_weights", None)
        if weights is not None and len(list(weights)) != len(keys):
            raise VerlConfigError(
                f"{self.name}: algorithm.gdpo_reward_weights has {len(list(weights))} weights "
                f"for {len(keys)} gdpo_reward_keys {keys}: give one weight per key"
            )
        verl_weights = {} if weights is None else dict(zip(keys, map(float, weights), strict=True))
        given = self.given.get("outcome") if isinstance(self.given, Mapping) else None
        own = given.get("weights") if isinstance(given, Mapping) else None
        if not own:
            outcome = dict(self.full["outcome"])
            return {**self.full, "outcome": {**outcome, "weights": verl_weights}}
        unknown = sorted(set(own) - set(keys))
        if unknown:
            raise VerlConfigError(
                f"{self.name}: its estimator weighs {unknown}, which are not among "
                f"algorithm.gdpo_reward_keys {keys}"
            )
        if weights is not None and any(float(own.get(k, 1.0)) != verl_weights[k] for k in keys):
            raise VerlConfigError(
                f"{self.name}: its estimator sets weights {dict(own)} but "
                f"algorithm.gdpo_reward_weights gives {verl_weights}: make them agree"
            )
        return self.full

    def gdpo_components(self, algorithm: Any, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """Each of verl's gdpo_reward_keys -> its per-row values, float64 (B,) (None: NaN, a
        value the rollout lacks), from ``given`` (the batch's non_tensor_batch fields)."""
        keys = self.reward_keys(algorithm)
        given = given or {}
        missing = [k for k in keys if k not in given]
        if missing:
            raise VerlConfigError(
                f"{self.name}: GDPO reward key {missing[0]!r} is not in the batch "
                f"(non_tensor_batch has {sorted(given)}): make compute_score return a dict "
                f"containing {missing[0]!r}"
            )
        return {k: np.asarray(list(given[k]), dtype=np.float64) for k in keys}

    def check_config(self, config: Any) -> None:
        """Checks of a whole verl config before training starts (the trainer's constructor)."""
        self.estimator_for(_setting(config, "algorithm", None))
        v1 = bool(_setting(_setting(config, "trainer", None), "use_v1", False))
        actor = _setting(_setting(config, "actor_rollout_ref", None), "actor", None)
        if "sum_pi_squared" in self.needs:
            if v1:
                raise VerlConfigError(
                    f"{self.name} needs sum_pi_squared, which verl 0.9's v1 trainer does not "
                    "compute: set trainer.use_v1=false and "
                    "actor_rollout_ref.actor.calculate_sum_pi_squared=True"
                )
            if not _setting(actor, "calculate_sum_pi_squared", False):
                raise VerlConfigError(
                    f"{self.name} needs sum_pi_squared: set "
                    "actor_rollout_ref.actor.calculate_sum_pi_squared=True"
                )

    # ---- the call ---------------------------------------------------------------------------

    def __call__(
        self,
        token_level_rewards: Any,
        response_mask: Any,
        index: Any = None,
        config: Any = None,
        responses: Any = None,
        teacher_log_probs: Mapping[str, Any] | None = None,
        prompt_keys: Any = None,
        norm_adv_by_std_in_grpo: bool | None = None,
        reward_components: Mapping[str, Any] | None = None,
        **inputs: Any,
    ) -> tuple[Any, Any]:
        if index is None:
            raise VerlConfigError(
                f"{self.name} needs the prompt uids (data.non_tensor_batch['uid'])"
            )
        estimator = self.estimator_for(config, norm_adv_by_std_in_grpo)
        if self.token_ids and responses is None:
            from .patching import responses_missing

            raise responses_missing(self.name)
        per_token = {
            BATCH_INPUTS[key]: value
            for key, value in inputs.items()
            if key in BATCH_INPUTS and value is not None and BATCH_INPUTS[key] in self.reads
        }
        teachers = dict(teacher_log_probs or {})
        for need in sorted(self.needs):
            if need.startswith("teacher_logprobs."):
                condition = need.split(".", 1)[1]
                if condition not in teachers:
                    raise VerlConfigError(
                        f"{self.name} needs teacher log-probs of condition {condition!r}: "
                        f"store them in data.batch['{TEACHER_PREFIX}{condition}'] (B, T) before "
                        "the advantage step"
                    )
            elif need not in per_token:
                raise VerlConfigError(
                    f"{self.name} needs {need}, which the batch lacks: "
                    f"{INPUT_HINTS.get(need, need)}"
                )
        if "returns" in self.reads:  # (OTB's G: verl's reward-to-go, as its own OTB uses)
            per_token["returns"] = reward_to_go(token_level_rewards, response_mask)
        if self.history and prompt_keys is None and self.prompt_key is not None:
            raise VerlConfigError(
                f"{self.name} keeps history per prompt and needs a prompt key: patch() passes "
                "a hash of the prompt's token ids (data.batch['prompts'] and "
                "['attention_mask']) or the non_tensor_batch field named by prompt_key"
            )
        rewards = token_level_rewards.sum(dim=-1)
        components = {}
        if self.gdpo:
            components["reward_components"] = self.gdpo_components(config, reward_components)
        retries_before = self.retry_stats.retries if self.retry_stats is not None else 0
        LAST_CALL.clear()
        try:
            result = self.compute_padded(
                responses if self.token_ids else None,
                response_mask,
                rewards,
                index,
                estimator=estimator,
                teacher_logprobs=teachers if "teacher_logprobs" in self.reads else None,
                ignore_token_ids=self.ignore_token_ids,
                namespace=self.namespace,
                request_id=f"verl:{self._request_prefix}:{self.name}:{next(self._calls)}",
                prompt_keys=prompt_keys if self.history else None,
                **components,
                **per_token,
            )
        except AdvantageError as exc:
            if self.fallback is None or exc.code not in UNREACHABLE:
                raise
            log.warning(
                "%s: the service is unreachable (%s); computing %s locally with verl's %s",
                self.name,
                exc.message,
                self.outcome,
                self.fallback,
            )
            FALLBACK_CALLS[self.name] = FALLBACK_CALLS.get(self.name, 0) + 1
            self._record(retries_before, fallback=True)
            return self._local(estimator, token_level_rewards, response_mask, index, config)
        self._record(retries_before, fallback=False)
        advantages = _to_torch(result.advantages, token_level_rewards)
        return advantages, advantages

    def _record(self, retries_before: int, fallback: bool) -> None:
        """The call's metrics (:data:`LAST_CALL`), read into the step's metrics by patch()."""
        retries = self.retry_stats.retries if self.retry_stats is not None else 0
        LAST_CALL.update(retries=float(retries - retries_before), fallback=float(fallback))

    def _local(
        self, estimator: Any, token_level_rewards: Any, response_mask: Any, index: Any, config: Any
    ) -> tuple[Any, Any]:
        """verl's own estimator of the same outcome (the fallback)."""
        from verl.trainer.ppo import core_algos

        assert self.fallback is not None
        fn = core_algos.get_adv_estimator_fn(self.fallback)
        norm = bool(estimator["outcome"].get("norm_by_std", True)) and self.outcome != "dr_grpo"
        kwargs: dict[str, Any] = {
            "token_level_rewards": token_level_rewards,
            "response_mask": response_mask,
            "index": index,
            "config": config,
        }
        accepted = inspect.signature(fn).parameters
        if "norm_adv_by_std_in_grpo" in accepted:
            kwargs["norm_adv_by_std_in_grpo"] = norm
        advantages, returns = fn(**kwargs)
        return advantages, returns


# Calls answered by the local fallback, per estimator name (a metric for the trainer's logs).
FALLBACK_CALLS: dict[str, int] = {}
# The last call's metrics (the client's retries, whether the fallback answered), which patch()
# adds to the step's metrics as advantage_service/<name>; emptied when a call starts.
LAST_CALL: dict[str, float] = {}


def make_estimators(
    chosen: Mapping[str, Any],
    listing: Mapping[str, Any],
    compute_padded: Callable[..., Any],
    **options: Any,
) -> dict[str, VerlEstimator]:
    """Each ``{name: estimator}`` checked against ``listing`` (unknown names, parameters, values
    out of range, inputs the integration cannot give: :class:`VerlConfigError`)."""
    out = {}
    for checked in adapter.checked_each(chosen, listing, PREFIX, VerlConfigError):
        for need in checked.needs:
            if need not in INPUT_HINTS and not need.startswith("teacher_logprobs."):
                raise VerlConfigError(
                    f"{checked.name} needs {need!r}, which the verl integration cannot take from "
                    "verl's batch"
                )
        out[checked.name] = VerlEstimator(checked, compute_padded, **options)
    return out


def register(
    transport: str = "inprocess",
    url: str | None = None,
    presets: Sequence[str] | Mapping[str, Any] | None = None,
    **client_options: Any,
) -> dict[str, VerlEstimator]:
    """Register the service's estimators with verl as ``adv_<name>``; returns them by name.

    ``transport``: ``inprocess`` (the ``advantage_service`` library in the trainer's process:
    ``pip install advantage-service``), ``http`` (Arrow) or ``grpc`` to a service at ``url``.
    ``presets``: preset names (default: every preset the service has) or ``{name: estimator}``.
    Each is checked against the service's ``GET /v1/estimators`` here (a misspelt name, an
    unknown or out-of-range parameter, an input verl cannot give: :class:`VerlConfigError`).

    ``client_options``: ``ignore_token_ids`` and ``namespace`` for every call; ``prompt_key``
    (``"hash"``, default: a hash of the prompt's token ids; a ``non_tensor_batch`` field name;
    None: the uid) for estimators with history; ``fallback=True`` to compute outcome-only
    estimators with verl's own when the service stays unreachable; ``retry_for`` (seconds,
    default 60) that a call keeps retrying a service that is down; ``estimators``
    (``{name: estimator object}`` registered beside ``presets``, every preset when None); the
    rest for the client (``timeout``, ``token``, ...). Registering a name again replaces it.
    """
    from verl.trainer.ppo import core_algos

    options = {
        **adapter.call_options(client_options),
        "prompt_key": client_options.pop("prompt_key", "hash"),
        "fallback": bool(client_options.pop("fallback", False)),
    }
    extra = client_options.pop("estimators", None)
    if transport != "inprocess":
        client_options.setdefault("retry_for", DEFAULT_RETRY_FOR)
    chosen_backend = backend(transport, url, client_options)
    options["retry_stats"] = getattr(chosen_backend, "retry_stats", None)
    listing = chosen_backend.list_estimators()
    chosen = adapter.chosen_estimators(listing, presets)
    chosen.update(extra or {})  # (named estimator objects beside the presets)
    made = make_estimators(chosen, listing, chosen_backend.compute_padded, **options)
    for verl_name, fn in made.items():
        # register_adv_est refuses a different function under a taken name: replace ours.
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(verl_name, None)
        core_algos.register_adv_est(verl_name)(fn)
        REGISTERED[verl_name] = fn
    return made
