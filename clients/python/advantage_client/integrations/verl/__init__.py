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
For an estimator with history, each group's ``prompt_key`` is the contract's key of its
prompt's token ids (:func:`advantage_contract.prompt_keys.prompt_key`, what every trainer
integration sends; ``prompt_key="hash"``, the default) or a ``non_tensor_batch`` field you name.

Failing early: the trainers' constructors check the ``adv_*`` name their config selects (one
registered neither here nor with verl is an error then, not at the first advantage step) and
the settings of a registered one. Retries: the client logs each wait
(``advantage_client.retry``) and the step's metrics get ``advantage_service/retries``.

Modules: :mod:`.estimator` (the estimators and :func:`register`), :mod:`.ray_env` (the Ray setup
hook and its ``ADVANTAGE_VERL_*`` settings), :mod:`.compute_advantage` (verl's
``compute_advantage`` patched, prompt keys of the batch), :mod:`.v1` (the v1 trainer's advantage
step and fetch), :mod:`.patching` (:func:`patch`, :func:`unpatch`), :mod:`.prompt_keys` and
:mod:`.common` (what they share).
"""

from __future__ import annotations

# Every name is its submodule's own object (one REGISTERED dict, one _V1_STEP context variable):
# mutating one here is mutating the one the code reads, but rebinding a name here is not seen
# by the submodule that reads it (rebind it there).
from .common import BATCH_INPUTS as BATCH_INPUTS
from .common import EXTRA_KWARGS as EXTRA_KWARGS
from .common import HOOK as HOOK
from .common import TEACHER_PREFIX as TEACHER_PREFIX
from .common import VerlConfigError as VerlConfigError
from .common import _estimator_name as _estimator_name
from .common import _setting as _setting
from .compute_advantage import _keys_of as _keys_of
from .compute_advantage import _prompt_keys as _prompt_keys
from .compute_advantage import patched_compute_advantage as patched_compute_advantage
from .estimator import DEFAULT_RETRY_FOR as DEFAULT_RETRY_FOR
from .estimator import FALLBACK_CALLS as FALLBACK_CALLS
from .estimator import INPUT_HINTS as INPUT_HINTS
from .estimator import LAST_CALL as LAST_CALL
from .estimator import LOCAL_FALLBACK as LOCAL_FALLBACK
from .estimator import PREFIX as PREFIX
from .estimator import REGISTERED as REGISTERED
from .estimator import UNREACHABLE as UNREACHABLE
from .estimator import VerlEstimator as VerlEstimator
from .estimator import _to_torch as _to_torch
from .estimator import log as log
from .estimator import make_estimators as make_estimators
from .estimator import register as register
from .estimator import reward_to_go as reward_to_go
from .patching import _ORIGINALS as _ORIGINALS
from .patching import _checked_init as _checked_init
from .patching import _replace as _replace
from .patching import call_metrics as call_metrics
from .patching import check_trainer_config as check_trainer_config
from .patching import patch as patch
from .patching import patched_here as patched_here
from .patching import responses_missing as responses_missing
from .patching import unpatch as unpatch
from .prompt_keys import _as_numpy as _as_numpy
from .prompt_keys import prompt_hashes as prompt_hashes
from .prompt_keys import uid_names as uid_names
from .ray_env import ENV_OPTIONS as ENV_OPTIONS
from .ray_env import ENV_PRESETS as ENV_PRESETS
from .ray_env import ENV_TRANSPORT as ENV_TRANSPORT
from .ray_env import ENV_URL as ENV_URL
from .ray_env import runtime_env as runtime_env
from .ray_env import settings_from_env as settings_from_env
from .ray_env import setup as setup
from .v1 import _V1_STEP as _V1_STEP
from .v1 import V1_STEP_HAS as V1_STEP_HAS
from .v1 import _TransferQueueFetch as _TransferQueueFetch
from .v1 import _v1_compute_advantage as _v1_compute_advantage
from .v1 import v1_fields as v1_fields

__all__ = [
    "FALLBACK_CALLS",
    "HOOK",
    "REGISTERED",
    "VerlConfigError",
    "VerlEstimator",
    "call_metrics",
    "check_trainer_config",
    "patch",
    "register",
    "runtime_env",
    "settings_from_env",
    "setup",
    "unpatch",
]
