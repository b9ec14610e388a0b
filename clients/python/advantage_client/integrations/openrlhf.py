"""OpenRLHF (0.11.2): the service's advantages in ``RemoteExperienceMaker``.

OpenRLHF computes advantages in ``RemoteExperienceMaker.compute_advantages_and_returns``, inside
its ``PPOTrainer`` Ray actor. :func:`patch` replaces that method (and checks the estimator when
the maker is built); :func:`setup`, the Ray worker setup hook, patches every worker process, the
trainer actor included, with settings from ``ADVANTAGE_OPENRLHF_*`` variables. The one change to
a launch::

    ray job submit --runtime-env-json='{"worker_process_setup_hook":
        "advantage_client.integrations.openrlhf.setup", "env_vars": {
        "ADVANTAGE_OPENRLHF_URL": "http://advantage:8000",
        "ADVANTAGE_OPENRLHF_ESTIMATOR": "ktae"}}' \\
        -- python3 -m openrlhf.cli.train_ppo_ray --algo.advantage.estimator group_norm ...

What OpenRLHF still does, and what the service replaces:

- its length penalties (DAPO overlong, ProRL stop-properly) change the rewards first;
- its groups: a sample's index in the rollout batch (``Experience.index``) over
  ``n_samples_per_prompt`` is its group, as OpenRLHF's own group estimators reshape it;
- the service computes the advantage of every action token (``action_mask``, aligned with
  ``sequences[:, 1:]``) from the rewards, in place of OpenRLHF's baseline (``group_norm``,
  ``rloo``, ``dr_grpo``, ...) and its whitening; each group's prompt key (for history) is the
  contract's key (``advantage_contract.prompt_keys.prompt_key``) of its prompt's token ids (the
  tokens before its first action), as every integration sends it;
- its reward clip (``--reward.clip_range``) bounds the advantages, as it bounds its own shaped
  reward, and its KL penalty in the reward (``--algo.kl.init_coef`` without
  ``--algo.kl.use_loss``) is added as OpenRLHF's returns add it: each token gets
  ``-kl_coef`` times the KL summed from it to the end of its response;
- returns equal the advantages, as for OpenRLHF's critic-free estimators.

``--algo.advantage.estimator`` must not be ``gae`` (a critic's values: the service's estimators
are model-free); any other value only keeps OpenRLHF's own checks (``group_norm``: groups of
more than one sample).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import adapter, checks
from .adapter import CALL_OPTIONS as CALL_OPTIONS
from .adapter import group_keys as group_keys

HOOK = "advantage_client.integrations.openrlhf.setup"
ENV_ESTIMATOR = "ADVANTAGE_OPENRLHF_ESTIMATOR"
ENV_TRANSPORT = "ADVANTAGE_OPENRLHF_TRANSPORT"
ENV_URL = "ADVANTAGE_OPENRLHF_URL"
ENV_OPTIONS = "ADVANTAGE_OPENRLHF_OPTIONS"
# The per-token inputs OpenRLHF has at its advantage step: the actor's log-probs of the actions.
AVAILABLE_INPUTS = frozenset(("logprobs",))

_PATCHED = adapter.Patched()


class OpenRLHFConfigError(ValueError):
    """A setting of OpenRLHF or of the estimator the service's advantages cannot honour."""


def _setting(args: Any, path: str, default: Any) -> Any:
    node = args
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return default
    return node


class ServiceAdvantages(adapter.BatchCalls):
    """One experience maker's advantages from the service: the backend and the estimator,
    checked against the service's listing and OpenRLHF's arguments when built."""

    def __init__(
        self,
        args: Any,
        estimator: Any = "grpo",
        transport: str | None = None,
        url: str | None = None,
        **options: Any,
    ) -> None:
        openrlhf_estimator = _setting(args, "algo.advantage.estimator", "gae")
        if openrlhf_estimator == "gae":
            raise OpenRLHFConfigError(
                "--algo.advantage.estimator gae learns a critic's values, which the service's "
                "model-free estimators do not use: set --algo.advantage.estimator group_norm "
                "(the service's estimator then replaces its baseline)"
            )
        gamma = float(_setting(args, "algo.advantage.gamma", 1.0))
        if gamma != 1.0:
            raise OpenRLHFConfigError(
                f"--algo.advantage.gamma {gamma} discounts returns; the service's estimators do "
                "not (nor do OpenRLHF's group estimators): set --algo.advantage.gamma 1"
            )
        self.group_size = int(_setting(args, "rollout.n_samples_per_prompt", 1))
        super().__init__(transport, url, options)
        listing = self.backend.list_estimators()
        try:
            self.resolved = checks.resolve(listing, estimator)
        except checks.EstimatorCheckError as exc:
            raise OpenRLHFConfigError(f"{ENV_ESTIMATOR}={estimator!r}: {exc}") from exc
        self.reads = adapter.step_inputs(
            listing, self.resolved, estimator, AVAILABLE_INPUTS, "OpenRLHF", OpenRLHFConfigError
        )
        self.estimator = estimator

    def compute(self, maker: Any, experiences: list[Any], apply_length_penalties: Any) -> Any:
        """OpenRLHF's ``compute_advantages_and_returns`` with the service's advantages."""
        import torch

        args = maker.strategy.args
        for experience in experiences:
            dtype = torch.promote_types(experience.rewards.dtype, torch.float32)
            experience.rewards = experience.rewards.to(dtype)
        apply_length_penalties(experiences, args)

        n = self.group_size
        index = np.concatenate([np.asarray(e.index, dtype=np.int64) for e in experiences])
        rewards = torch.cat([e.rewards for e in experiences]).double()
        sizes = [len(e.index) for e in experiences]
        if n > 1:
            _group_reward_std(experiences, rewards, index, n)
        width = max(e.action_mask.shape[1] for e in experiences)
        tokens = torch.cat([_pad(e.sequences[:, 1:].long(), width) for e in experiences])
        mask = torch.cat([_pad(e.action_mask.bool(), width) for e in experiences])
        per_token: dict[str, Any] = {}
        if "logprobs" in self.reads and experiences[0].action_log_probs is not None:
            per_token["logprobs"] = torch.cat(
                [_pad(e.action_log_probs.float(), width) for e in experiences]
            )
        prompts = [_prompt_ids(e, row) for e in experiences for row in range(len(e.index))]
        groups = index // n
        result = self.compute_batch(
            tokens, mask, rewards, groups, prompts, self.estimator, per_token
        )
        advantages = torch.as_tensor(np.asarray(result.advantages, dtype=np.float32))
        scalars = torch.as_tensor(np.asarray(result.scalars, dtype=np.float32))
        clip = _setting(args, "reward.clip_range", None)
        if clip:
            advantages = advantages.clamp(min=clip[0], max=clip[1])
            scalars = scalars.clamp(min=clip[0], max=clip[1])
        kl_coef = max(float(maker.kl_ctl.value), 0.0)
        first = 0
        for experience, rows in zip(experiences, sizes, strict=True):
            action_mask = experience.action_mask
            own = advantages[first : first + rows, : action_mask.shape[1]].to(action_mask.device)
            total = scalars[first : first + rows].to(action_mask.device)
            first += rows
            if experience.kl is not None and kl_coef > 0.0:
                # OpenRLHF's return of token t adds the KL reward of every action from t on.
                kl_reward = -kl_coef * experience.kl.float() * action_mask
                to_go = kl_reward.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
                own = own + to_go * action_mask
                total = total + kl_reward.sum(dim=-1)
            experience.advantages = own
            experience.returns = own.clone()
            experience.info["return"] = total
            experience.kl = None
        return experiences


def _pad(values: Any, width: int) -> Any:
    import torch

    extra = width - values.shape[1]
    return torch.nn.functional.pad(values, (0, extra)) if extra else values


def _prompt_ids(experience: Any, row: int) -> np.ndarray:
    """The tokens before a sample's first action (``action_mask[j]`` marks ``sequences[j +
    1]``); its whole sequence when it has no action."""
    actions = np.flatnonzero(np.asarray(experience.action_mask[row].cpu().numpy()))
    sequence = np.asarray(experience.sequences[row].cpu().numpy())
    if actions.size == 0:
        attention = np.asarray(experience.attention_mask[row].cpu().numpy()).astype(bool)
        return sequence[attention]
    return sequence[: int(actions[0]) + 1]


def _group_reward_std(experiences: list[Any], rewards: Any, index: np.ndarray, n: int) -> None:
    """OpenRLHF's ``group_reward_std`` log entry (each sample's group's reward std)."""
    import torch

    ordered = torch.empty_like(rewards)
    ordered[torch.as_tensor(index)] = rewards
    stds = ordered.reshape(-1, n).std(-1, keepdim=True).repeat(1, n).reshape(-1)
    split = stds[torch.as_tensor(index)].float().split([len(e.index) for e in experiences])
    for experience, std in zip(experiences, split, strict=True):
        experience.info["group_reward_std"] = std


def patch(
    estimator: Any = "grpo",
    transport: str | None = None,
    url: str | None = None,
    **options: Any,
) -> None:
    """Make OpenRLHF's ``RemoteExperienceMaker`` compute advantages through the service:
    ``estimator`` a preset name or an estimator object; ``transport`` ``http``, ``grpc`` (then
    ``url``) or ``inprocess`` (None: ``http`` when ``url`` is given); ``options``:
    ``ignore_token_ids`` and ``namespace`` for every call, the rest for the client. The
    estimator is checked when a maker is built (OpenRLHF's ``PPOTrainer``), before training."""
    from openrlhf.trainer.ppo_utils import experience_maker

    maker_class = experience_maker.RemoteExperienceMaker
    replaced = ("__init__", "compute_advantages_and_returns")
    original_init = _PATCHED.keep(maker_class, replaced)["__init__"]
    settings = dict(options)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.advantage_service = ServiceAdvantages(
            self.strategy.args, estimator, transport, url, **settings
        )

    def compute_advantages_and_returns(self: Any, experiences: list[Any]) -> list[Any]:
        import torch

        with torch.no_grad():
            return self.advantage_service.compute(
                self, experiences, experience_maker.apply_length_penalties
            )

    maker_class.__init__ = __init__
    maker_class.compute_advantages_and_returns = compute_advantages_and_returns


def unpatch() -> None:
    """Restore OpenRLHF's own ``RemoteExperienceMaker``."""
    _PATCHED.restore()


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`patch`'s arguments from ``ADVANTAGE_OPENRLHF_ESTIMATOR`` (a preset name or a JSON
    estimator object; default ``grpo``), ``ADVANTAGE_OPENRLHF_TRANSPORT``,
    ``ADVANTAGE_OPENRLHF_URL`` and ``ADVANTAGE_OPENRLHF_OPTIONS`` (a JSON object of options)."""
    return adapter.settings_from_env(env, "ADVANTAGE_OPENRLHF", OpenRLHFConfigError)


def setup() -> None:
    """The Ray worker setup hook: :func:`patch` with settings from ``ADVANTAGE_OPENRLHF_*`` in
    every worker, OpenRLHF's ``PPOTrainer`` actor included (the driver never makes
    experiences)."""
    patch(**settings_from_env())
