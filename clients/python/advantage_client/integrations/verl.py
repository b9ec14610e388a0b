"""verl (0.9.x): the service's estimators as verl advantage estimators, in the Ray workers where
training runs, on the legacy trainer and on the v1 trainer (verl 0.9's default).

One line in a verl launch (the estimators registered and ``compute_advantage`` patched in every
Ray worker, the TaskRunner that runs ``fit`` included)::

    ADVANTAGE_VERL_TRANSPORT=http ADVANTAGE_VERL_URL=http://advantage:8000 \\
    python -m verl.trainer.main_ppo algorithm.adv_estimator=adv_ktae ... \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=advantage_client.integrations.verl.setup

or, when the script starts Ray itself, ``ray.init(runtime_env=adv_verl.runtime_env("http",
url))``. :func:`setup` reads its settings from ``ADVANTAGE_VERL_*`` variables (workers inherit
the launching shell's environment when ``ray.init`` starts the cluster; on an existing cluster
put them in the runtime_env's ``env_vars``, which :func:`runtime_env` does). ``register()`` and
``patch()`` called in the launch script only act in the driver, which never computes advantages.

:func:`register` adds each preset as ``adv_<preset>`` to verl's estimator registry, each checked
against the service's listing first (names, parameters, inputs). verl calls a registered
estimator with ``token_level_rewards``, ``response_mask``, ``index`` (the uids) and ``config``;
:func:`patch` makes ``compute_advantage`` also pass what token-level estimators read:

=========================== ==========================================================
``data.batch`` key          sent as
=========================== ==========================================================
``responses``               the token ids (B, T)
``old_log_probs``           ``logprobs`` (OPSD, OTB)
``entropys`` / ``entropy``  ``entropy`` (forking tokens, GTPO, GRPO-S; legacy / v1 trainer)
``sum_pi_squared``          ``sum_pi_squared`` (OTB)
``rollout_is_weights``      ``is_weights`` (OTB, when present)
``planning_mask``           ``planning_mask`` (HICRA, when present: else the service's
                            tokenizer finds planning tokens, when it has one)
``teacher_log_probs.<c>``   ``teacher_logprobs[<c>]`` (CSCR's pos/neg, OPSD's teacher)
=========================== ==========================================================

On the v1 trainer, whose advantage step fetches only a few fields from its transfer queue,
:func:`patch` makes that fetch also bring the fields the estimator reads (``responses``, the
prompts for the prompt key, ...).

Rewards: ``token_level_rewards`` may be spread over tokens (verl's KL penalty in the reward).
Every outcome (and the terms built on it) uses each row's sum, as verl's own outcome estimators
do; OTB uses the reward-to-go of each token, as verl's ``optimal_token_baseline`` does.

Prompt keys: verl's uid is a fresh uuid4 per step, so KTAE history keyed by it never applies.
For an estimator with history, each group's ``prompt_key`` is a hash of its prompt's token ids
(``prompt_key="hash"``, the default) or a ``non_tensor_batch`` field you name.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib
import inspect
import itertools
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np

from ..errors import AdvantageError
from . import backend
from .checks import EstimatorCheckError, required_inputs, resolve, uses_history

log = logging.getLogger("advantage_client.verl")

PREFIX = "adv_"
HOOK = "advantage_client.integrations.verl.setup"
ENV_TRANSPORT = "ADVANTAGE_VERL_TRANSPORT"
ENV_URL = "ADVANTAGE_VERL_URL"
ENV_PRESETS = "ADVANTAGE_VERL_PRESETS"
ENV_OPTIONS = "ADVANTAGE_VERL_OPTIONS"
# Default total time a call keeps retrying a service that is down (a rolling restart).
DEFAULT_RETRY_FOR = 60.0
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
EXTRA_KWARGS = ("responses", "teacher_log_probs", "prompt_keys", "norm_adv_by_std_in_grpo")
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
# (module or class, attribute) -> what patch() replaced there.
_ORIGINALS: dict[tuple[Any, str], Any] = {}
# The v1 trainer's advantage step in progress: its estimator and what the fetch brought.
_V1_STEP: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "advantage_verl_v1_step", default=None
)


class VerlConfigError(ValueError):
    """A verl setting the service's estimator cannot honour, or an input verl does not give."""


def _to_torch(values: Any, like: Any) -> Any:
    import torch

    if isinstance(values, torch.Tensor):
        return values.to(like.device)
    return torch.from_numpy(np.asarray(values)).to(like.device)


def _setting(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if hasattr(config, "get"):
        try:
            return config.get(key, default)
        except (AttributeError, KeyError, TypeError):
            pass
    return getattr(config, key, default)


def reward_to_go(token_level_rewards: Any, response_mask: Any) -> Any:
    """G_t = sum_{j >= t} r_j per row, as verl's optimal_token_baseline computes its returns."""
    masked = token_level_rewards * response_mask
    return masked.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


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
    # One blake2b per distinct prompt (the keys history is stored under: a hash computed by
    # numpy would move every stored prompt's history).
    for row in first.tolist():
        ids = _as_numpy(prompts[row])
        if mask is not None:
            ids = ids[_as_numpy(mask[row]).astype(bool)]
        digest = hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=16)
        keys.append("p:" + digest.hexdigest())
    return np.asarray(keys, dtype=object)[inverse.reshape(-1)]


def _as_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)


class VerlEstimator:
    """A verl advantage estimator (``register_adv_est``'s signature, plus the keywords
    :func:`patch` adds) computing one service estimator through ``compute_padded``."""

    def __init__(
        self,
        name: str,
        given: Any,
        full: Mapping[str, Any],
        needs: set[str],
        compute_padded: Callable[..., Any],
        *,
        ignore_token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
        prompt_key: str | None = "hash",
        fallback: bool = False,
    ) -> None:
        from ..padded import needs_token_ids

        self.name = name
        self.given = given
        self.full = dict(full)
        self.needs = needs
        self.compute_padded = compute_padded
        self.ignore_token_ids = ignore_token_ids
        self.namespace = namespace
        self.prompt_key = prompt_key
        self.history = uses_history(full)
        self.outcome = str((full.get("outcome") or {}).get("name", "grpo"))
        self.token_ids = needs_token_ids(full)
        self.reads = {n.split(".")[0] for n in needs} | (
            {"returns"} if self.outcome == "otb" else set()
        )
        self.fallback = LOCAL_FALLBACK.get(self.outcome) if fallback else None
        if fallback and (self.fallback is None or self.token_ids or full.get("clip") is not None):
            raise VerlConfigError(
                f"{name}: the local fallback covers outcome-only estimators equal to one of "
                f"verl's ({sorted(LOCAL_FALLBACK)}, no terms, no clip); {self.full} is not one: "
                "register it without fallback"
            )
        # Each call's request id (this process's random prefix, the estimator, a count): a call
        # the client retries after its connection was cut, once the service had counted it, is
        # not counted again.
        self._request_prefix = uuid.uuid4().hex
        self._calls = itertools.count()
        self.__name__ = f"compute_{name}_advantage"
        self.__doc__ = f"advantage-service estimator {given!r} as verl estimator {name!r}."

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
        **inputs: Any,
    ) -> tuple[Any, Any]:
        if index is None:
            raise VerlConfigError(
                f"{self.name} needs the prompt uids (data.non_tensor_batch['uid'])"
            )
        estimator = self.estimator_for(config, norm_adv_by_std_in_grpo)
        if self.token_ids and responses is None:
            raise VerlConfigError(
                f"{self.name} needs the response token ids: patch() must run in the process "
                "that trains (the TaskRunner): use the Ray setup hook "
                f"(worker_process_setup_hook={HOOK!r}) so that compute_advantage passes "
                "data.batch['responses']"
            )
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
        if self.outcome == "otb":
            per_token["returns"] = reward_to_go(token_level_rewards, response_mask)
        if self.history and prompt_keys is None and self.prompt_key is not None:
            raise VerlConfigError(
                f"{self.name} keeps history per prompt and needs a prompt key: patch() passes "
                "a hash of the prompt's token ids (data.batch['prompts'] and "
                "['attention_mask']) or the non_tensor_batch field named by prompt_key"
            )
        rewards = token_level_rewards.sum(dim=-1)
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
            return self._local(estimator, token_level_rewards, response_mask, index, config)
        advantages = _to_torch(result.advantages, token_level_rewards)
        return advantages, advantages

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


def listing_of(transport: str, client: Any) -> dict[str, Any]:
    """The service's estimator listing (``GET /v1/estimators``), or the library's in-process."""
    if client is None:
        from advantage_service.wire.listing import estimator_listing

        return dict(estimator_listing())
    return dict(client.list_estimators())


def make_estimators(
    chosen: Mapping[str, Any],
    listing: Mapping[str, Any],
    compute_padded: Callable[..., Any],
    **options: Any,
) -> dict[str, VerlEstimator]:
    """Each ``{name: estimator}`` checked against ``listing`` (unknown names, parameters, values
    out of range, inputs the integration cannot give: :class:`VerlConfigError`)."""
    out = {}
    for name, estimator in chosen.items():
        verl_name = name if name.startswith(PREFIX) else PREFIX + name
        try:
            full = resolve(listing, estimator)
        except EstimatorCheckError as exc:
            raise VerlConfigError(f"{verl_name}: {exc}") from None
        needs = required_inputs(listing, full)
        for need in needs:
            if need not in INPUT_HINTS and not need.startswith("teacher_logprobs."):
                raise VerlConfigError(
                    f"{verl_name} needs {need!r}, which the verl integration cannot take from "
                    "verl's batch"
                )
        out[verl_name] = VerlEstimator(verl_name, estimator, full, needs, compute_padded, **options)
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
    default 60) that a call keeps retrying a service that is down; the rest for the client
    (``timeout``, ``token``, ...). Registering a name again replaces it.
    """
    from verl.trainer.ppo import core_algos

    options = {
        "ignore_token_ids": client_options.pop("ignore_token_ids", None),
        "namespace": client_options.pop("namespace", None),
        "prompt_key": client_options.pop("prompt_key", "hash"),
        "fallback": bool(client_options.pop("fallback", False)),
    }
    if transport != "inprocess":
        client_options.setdefault("retry_for", DEFAULT_RETRY_FOR)
    compute_padded, _, client = backend(transport, url, client_options)
    listing = listing_of(transport, client)
    if presets is None:
        chosen: dict[str, Any] = {name: name for name in listing.get("presets", {})}
    elif isinstance(presets, Mapping):
        chosen = dict(presets)
    else:
        chosen = {name: name for name in presets}
    made = make_estimators(chosen, listing, compute_padded, **options)
    for verl_name, fn in made.items():
        # register_adv_est refuses a different function under a taken name: replace ours.
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(verl_name, None)
        core_algos.register_adv_est(verl_name)(fn)
        REGISTERED[verl_name] = fn
    return made


# ---- the Ray workers ----------------------------------------------------------------------------


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`register`'s arguments from ``ADVANTAGE_VERL_TRANSPORT`` (default inprocess),
    ``ADVANTAGE_VERL_URL``, ``ADVANTAGE_VERL_PRESETS`` (comma-separated names; default all) and
    ``ADVANTAGE_VERL_OPTIONS`` (a JSON object: the keyword options, and ``estimators``, a
    ``{name: estimator object}`` registered beside the presets)."""
    env = os.environ if env is None else env
    options = json.loads(env.get(ENV_OPTIONS) or "{}")
    if not isinstance(options, dict):
        raise VerlConfigError(f"{ENV_OPTIONS} must be a JSON object, got {options!r}")
    presets: Any = None
    names = [n.strip() for n in (env.get(ENV_PRESETS) or "").split(",") if n.strip()]
    objects = options.pop("estimators", None)
    if names or objects:
        presets = {**{n: n for n in names}, **(objects or {})}
    return {
        "transport": env.get(ENV_TRANSPORT) or "inprocess",
        "url": env.get(ENV_URL) or None,
        "presets": presets,
        **options,
    }


def setup() -> None:
    """The Ray worker setup hook: :func:`register` (settings from ``ADVANTAGE_VERL_*``) and
    :func:`patch` in every worker process, so the TaskRunner that runs ``fit`` has them.

    ``ray.init(runtime_env={"worker_process_setup_hook":
    "advantage_client.integrations.verl.setup"})``, or from verl's config:
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=advantage_client.integrations.verl.setup``.
    A bad setting fails the worker at start with this error."""
    settings = settings_from_env()
    register(settings.pop("transport"), settings.pop("url"), settings.pop("presets"), **settings)
    patch()


def runtime_env(
    transport: str = "inprocess",
    url: str | None = None,
    presets: Sequence[str] | None = None,
    estimators: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """A Ray ``runtime_env`` (``base`` plus) that runs :func:`setup` in every worker with these
    settings: ``ray.init(runtime_env=runtime_env("http", "http://advantage:8000"))``."""
    env = dict(base or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars[ENV_TRANSPORT] = transport
    if url is not None:
        env_vars[ENV_URL] = url
    if presets is not None:
        env_vars[ENV_PRESETS] = ",".join(presets)
    if estimators is not None:
        options = {**options, "estimators": dict(estimators)}
    if options:
        env_vars[ENV_OPTIONS] = json.dumps(options)
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = HOOK
    return env


# ---- compute_advantage --------------------------------------------------------------------------


def _estimator_name(adv_estimator: Any) -> str:
    return str(adv_estimator.value if isinstance(adv_estimator, Enum) else adv_estimator)


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
        advantages, returns = fn(**kwargs)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return data

    compute_advantage.__wrapped__ = original  # type: ignore[attr-defined]
    return compute_advantage


# ---- the v1 trainer -----------------------------------------------------------------------------


def v1_fields(fn: VerlEstimator) -> list[str]:
    """The transfer-queue fields the v1 advantage step must also fetch for ``fn``."""
    fields = ["responses"] if fn.token_ids else []
    fields += [key for key, name in BATCH_INPUTS.items() if name in fn.reads and key == "entropy"]
    if "sum_pi_squared" in fn.reads:
        fields.append("sum_pi_squared")
    fields += [
        TEACHER_PREFIX + need.split(".", 1)[1]
        for need in sorted(fn.needs)
        if need.startswith("teacher_logprobs.")
    ]
    if fn.history and fn.prompt_key is not None:
        fields.append("prompts" if fn.prompt_key == "hash" else fn.prompt_key)
    return fields


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
        extra = [f for f in v1_fields(fn) if f not in select_fields]
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
        return data


def _v1_compute_advantage(original: Callable[..., Any]) -> Callable[..., Any]:
    """The v1 trainer's ``_compute_advantage`` with the step's estimator known to the fetch."""

    def _compute_advantage(self: Any, batch: Any, metrics: dict[str, Any]) -> Any:
        fn = REGISTERED.get(_estimator_name(self.config.algorithm.adv_estimator))
        if fn is None:
            return original(self, batch, metrics)
        token = _V1_STEP.set({"estimator": fn})
        try:
            return original(self, batch, metrics)
        finally:
            _V1_STEP.reset(token)

    _compute_advantage.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_advantage


def _checked_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """A trainer's ``__init__`` that checks the config of an estimator registered here before
    anything loads (settings verl would ignore, inputs it will not compute)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = getattr(self, "config", None)
        algorithm = _setting(config, "algorithm", None)
        fn = REGISTERED.get(_estimator_name(_setting(algorithm, "adv_estimator", "")))
        if fn is not None:
            fn.check_config(config)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def _replace(owner: Any, attribute: str, wrap: Callable[[Any], Any]) -> None:
    if (owner, attribute) not in _ORIGINALS:
        current = getattr(owner, attribute)
        _ORIGINALS[(owner, attribute)] = current
        setattr(owner, attribute, wrap(current))


def patch() -> list[str]:
    """Make verl pass the estimators registered here what they need; returns what it patched.
    Idempotent; :func:`unpatch` undoes it.

    - ``verl.trainer.ppo.ray_trainer.compute_advantage`` (the legacy trainer's ``fit`` looks it
      up there) and the name ``verl.trainer.ppo.v1.utils`` imported (the v1 trainer);
    - the v1 trainer's advantage step fetches the fields the estimator reads (``responses``,
      the prompts, ...) from its transfer queue (when ``verl.trainer.ppo.v1`` imports: it
      needs the ``transfer_queue`` package);
    - both trainers' constructors check the config of an estimator registered here.
    """
    patched = []
    ray_trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
    _replace(ray_trainer, "compute_advantage", patched_compute_advantage)
    _replace(ray_trainer.RayPPOTrainer, "__init__", _checked_init)
    patched.append("verl.trainer.ppo.ray_trainer")
    try:
        v1_utils = importlib.import_module("verl.trainer.ppo.v1.utils")
        trainer_base = importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    except ImportError:  # the v1 trainer needs transfer_queue
        return patched
    _replace(v1_utils, "compute_advantage", patched_compute_advantage)
    _replace(trainer_base, "tq", _TransferQueueFetch)
    _replace(trainer_base.PPOTrainer, "_compute_advantage", _v1_compute_advantage)
    _replace(trainer_base.PPOTrainer, "__init__", _checked_init)
    patched += ["verl.trainer.ppo.v1.utils", "verl.trainer.ppo.v1.trainer_base"]
    return patched


def unpatch() -> None:
    """Put back what :func:`patch` replaced."""
    for (owner, attribute), original in list(_ORIGINALS.items()):
        setattr(owner, attribute, original)
        del _ORIGINALS[(owner, attribute)]


__all__ = [
    "FALLBACK_CALLS",
    "HOOK",
    "REGISTERED",
    "VerlConfigError",
    "VerlEstimator",
    "patch",
    "register",
    "runtime_env",
    "settings_from_env",
    "setup",
    "unpatch",
]
