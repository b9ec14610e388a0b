"""AReaL (1.0.4): the service's advantages in ``PPOActor.compute_advantages``.

:func:`patch` replaces the batch step of AReaL's ``PPOActor.compute_advantages``
(``_compute_advantages``; AReaL's ``batched_call`` still concatenates and splits the
trajectories) and checks the estimator when an actor is built. Call it where the actor's engine
runs, before the trainer is built::

    from advantage_client.integrations import areal as adv_areal

    adv_areal.patch("ktae", url="http://advantage:8000")
    with PPOTrainer(config, train_dataset=...) as trainer:
        trainer.train(workflow=...)

or set ``ADVANTAGE_AREAL_*`` variables and call :func:`setup` (the same, from the environment).

What AReaL still does, and what the service replaces:

- its overlong penalty, ``reward_bias``, ``reward_scaling`` and ``reward_clip`` make each
  trajectory's reward first;
- its ``reward_norm`` (a ``NormConfig``) is the service's outcome scaling: ``mean_level`` and
  ``std_level`` become the ``grpo`` outcome's ``mean_scope`` and ``std_scope`` (``group`` ->
  ``group``, ``batch`` -> ``request``: the call holds AReaL's whole batch, None -> ``none``),
  ``mean_leave1out`` -> ``leave_one_out``, ``std_unbiased``, ``eps`` -> ``epsilon``, with the
  std taken about the baseline subtracted (``std_center: "baseline"``, as ``Normalization``);
  ``reward_norm: null`` sends the rewards unscaled. Each ``group_size`` consecutive rows are a
  group (a prompt's samples);
- the service computes the advantage of every loss token (``loss_mask`` over ``input_ids``),
  shifted onto AReaL's next-token layout (its ``loss_mask`` rolled by one), in place of the
  outcome part of AReaL's returns; each group's prompt key (for history) is the contract's key
  (``advantage_contract.prompt_keys.prompt_key``) of its prompt's token ids (the tokens before
  its first loss token), as every integration sends it;
- its KL reward (``kl_ctl`` times its ``kl_estimator`` of the old and reference log-probs) is
  added as its returns add it, each position getting the KL rewards of the loss positions from
  it on; ``mask_no_eos_with_zero`` zeroes the service's part of a trajectory without EOS; its
  ``adv_norm`` then normalises the advantages as before.

A critic (``values`` in the batch), ``discount`` or ``gae_lambda`` other than 1 are refused:
the service's estimators are model-free group baselines that do not discount.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import adapter, checks
from .adapter import CALL_OPTIONS as CALL_OPTIONS
from .adapter import group_keys as group_keys

ENV_ESTIMATOR = "ADVANTAGE_AREAL_ESTIMATOR"
ENV_TRANSPORT = "ADVANTAGE_AREAL_TRANSPORT"
ENV_URL = "ADVANTAGE_AREAL_URL"
ENV_OPTIONS = "ADVANTAGE_AREAL_OPTIONS"
# The per-token inputs AReaL has at its advantage step: the old policy's log-probs.
AVAILABLE_INPUTS = frozenset(("logprobs",))
SCOPES = {"group": "group", "batch": "request", None: "none"}
SCALING = ("mean_scope", "std_scope", "leave_one_out", "std_unbiased", "epsilon", "std_center")

_PATCHED = adapter.Patched()


class AReaLConfigError(ValueError):
    """A setting of AReaL or of the estimator the service's advantages cannot honour."""


def norm_scaling(norm: Any) -> dict[str, Any]:
    """The ``grpo`` outcome's scaling parameters of an AReaL ``NormConfig`` (None: unscaled)."""
    if norm is None:
        return {"mean_scope": "none", "std_scope": "none"}
    return {
        "mean_scope": SCOPES[norm.mean_level],
        "std_scope": SCOPES[norm.std_level],
        "leave_one_out": bool(norm.mean_leave1out),
        "std_unbiased": bool(norm.std_unbiased),
        "epsilon": float(norm.eps),
        "std_center": "baseline",
    }


class ServiceAdvantages(adapter.BatchCalls):
    """One actor's advantages from the service: the backend and the estimator (AReaL's
    ``reward_norm`` mapped onto it), checked against the service's listing and AReaL's
    ``PPOActorConfig`` when built."""

    def __init__(
        self,
        config: Any,
        estimator: Any = "grpo",
        transport: str | None = None,
        url: str | None = None,
        group_size: int | None = None,
        **options: Any,
    ) -> None:
        for name in ("discount", "gae_lambda"):
            value = float(getattr(config, name, 1.0))
            if value != 1.0:
                raise AReaLConfigError(
                    f"actor.{name}={value} discounts returns; the service's estimators are group "
                    f"baselines that do not: set actor.{name}=1.0"
                )
        norm: Any = getattr(config, "reward_norm", None)
        grouped = norm is not None and "group" in (norm.mean_level, norm.std_level)
        if grouped and group_size is not None and group_size != norm.group_size:
            raise AReaLConfigError(
                f"group_size={group_size} but actor.reward_norm.group_size={norm.group_size}: "
                "give one of them"
            )
        self.group_size = int(group_size or (norm.group_size if norm is not None else 1))
        super().__init__(transport, url, options)
        listing = self.backend.list_estimators()
        try:
            resolved = checks.resolve(listing, estimator)
        except checks.EstimatorCheckError as exc:
            raise AReaLConfigError(f"estimator {estimator!r}: {exc}") from exc
        outcome = dict(resolved["outcome"])
        given = estimator.get("outcome") if isinstance(estimator, Mapping) else None
        set_here = sorted(set(given or {}) & set(SCALING)) if isinstance(given, Mapping) else []
        if set_here:
            raise AReaLConfigError(
                f"estimator {estimator!r} sets {set_here}: the scaling of the rewards is AReaL's "
                "actor.reward_norm (mean_level, std_level, mean_leave1out, std_unbiased, eps)"
            )
        if outcome["name"] != "grpo" and norm is not None:
            raise AReaLConfigError(
                f"actor.reward_norm normalises the rewards, and the estimator's outcome "
                f"{outcome['name']!r} has its own baseline: set actor.reward_norm=null, or use "
                "an estimator whose outcome is grpo"
            )
        if outcome["name"] == "grpo":
            outcome.update(norm_scaling(norm))
        self.estimator = {**resolved, "outcome": outcome}
        try:  # (a service without AReaL's scaling parameters refuses them: now, not at step 1)
            checks.resolve(listing, self.estimator)
        except checks.EstimatorCheckError as exc:
            raise AReaLConfigError(f"actor.reward_norm={norm!r}: this service: {exc}") from exc
        self.reads = adapter.step_inputs(
            listing, self.estimator, estimator, AVAILABLE_INPUTS, "AReaL", AReaLConfigError
        )

    def call(self, data: Mapping[str, Any], rewards: Any, old_logp: Any) -> Any:
        """The service's advantages (B, L) float32 aligned with ``input_ids`` (0 off the loss
        mask)."""
        import torch

        tokens = data["input_ids"]
        mask = data["loss_mask"].bool()
        rows = tokens.shape[0]
        if rows % self.group_size:
            raise AReaLConfigError(
                f"a batch of {rows} trajectories is not whole groups of {self.group_size} "
                "(group_size: each prompt's samples, consecutive)"
            )
        groups = np.arange(rows) // self.group_size
        per_token: dict[str, Any] = {}
        if "logprobs" in self.reads:
            # (AReaL's old log-probs are in its next-token layout: back onto the tokens)
            per_token["logprobs"] = torch.roll(old_logp.float(), shifts=1, dims=-1) * mask
        prompts = [_prompt_ids(tokens, mask, r) for r in range(rows)]
        result = self.compute_batch(
            tokens, mask, rewards.double(), groups, prompts, self.estimator, per_token
        )
        advantages = torch.as_tensor(np.asarray(result.advantages, dtype=np.float32))
        return advantages.to(tokens.device), torch.as_tensor(np.asarray(result.scalars))

    def compute(self, actor: Any, data: dict[str, Any], overlong_penalty: Any) -> dict[str, Any]:
        """AReaL's ``PPOActor._compute_advantages`` with the service's advantages."""
        import torch

        if data.get("values") is not None:
            raise AReaLConfigError(
                "the batch has a critic's values: the service's estimators are model-free "
                "(train without a critic, or without the service)"
            )
        config = actor.config
        ids = data["input_ids"]
        bs = ids.shape[0]
        batch_indices = torch.arange(bs, device=ids.device, dtype=torch.long)
        if config.overlong_reward_penalty:
            data = overlong_penalty(
                data,
                overlong_tokens=config.overlong_tokens,
                overlong_penalty_factor=config.overlong_penalty_factor,
                max_response_length=config.max_new_tokens,
            )
        reward_score = (data["rewards"] + actor.reward_bias) * actor.reward_scaling
        reward_score = torch.clip(reward_score, max=actor.reward_clip, min=-actor.reward_clip)

        # AReaL's next-token layout: position t holds token t + 1's mask and log-prob.
        loss_mask = torch.roll(data["loss_mask"].float(), shifts=-1, dims=-1)
        if not config.use_decoupled_loss and config.recompute_logprob:
            if data.get("prox_logp") is None:
                raise ValueError("prox_logp is None but recompute_logprob=True")
            old_logp = data["logprobs"] = data["prox_logp"]
        else:
            old_logp = torch.roll(data["logprobs"], shifts=-1, dims=-1)
            if not config.use_decoupled_loss:
                data["prox_logp"] = old_logp
        ref_logp = data.get("ref_logp")
        if ref_logp is None:
            ref_logp = torch.zeros_like(old_logp)
        ref_logp *= loss_mask
        old_logp *= loss_mask

        service, scalars = self.call(data, reward_score, old_logp)
        outcome = torch.zeros_like(service)
        outcome[:, :-1] = service[:, 1:]
        attn_mask = data["attention_mask"]
        seqlens = attn_mask.sum(-1).long()
        seq_no_eos_mask = seqlens == attn_mask.shape[1]
        scalars = scalars.to(reward_score.device, reward_score.dtype)
        if actor.mask_no_eos_with_zero:
            outcome = outcome * (~seq_no_eos_mask).unsqueeze(-1)
            scalars = torch.where(seq_no_eos_mask, 0, scalars)

        kl_rewards = -actor.kl_ctl * actor.kl_estimator(old_logp, ref_logp)
        rewards = kl_rewards.clone()
        rewards[batch_indices, seqlens - 1] = 0
        # AReaL's returns at discount and lambda 1 without values: at each position, the rewards
        # of the loss positions from it on (its last position excluded).
        masked = rewards.float() * loss_mask
        masked[:, -1] = 0
        kl_to_go = masked.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = outcome + kl_to_go
        rewards[batch_indices, torch.clip(seqlens - 2, min=0)] += scalars
        data["returns"] = advantages.clone()
        if actor.adv_norm is not None:
            advantages = actor.adv_norm(advantages, loss_mask)
        data["advantages"] = advantages
        data["kl_rewards"] = kl_rewards
        data["tot_rewards"] = rewards
        data["loss_mask"] = loss_mask
        data["logprobs"] = old_logp
        return data


def _prompt_ids(tokens: Any, mask: Any, row: int) -> np.ndarray:
    """The tokens before a trajectory's first loss token (all of them when it has none)."""
    ids = np.asarray(tokens[row].cpu().numpy())
    loss = np.flatnonzero(np.asarray(mask[row].cpu().numpy()))
    return ids[: int(loss[0])] if loss.size else ids


def patch(
    estimator: Any = "grpo",
    transport: str | None = None,
    url: str | None = None,
    group_size: int | None = None,
    **options: Any,
) -> None:
    """Make AReaL's ``PPOActor`` compute advantages through the service: ``estimator`` a preset
    name or an estimator object (its outcome's scaling comes from AReaL's ``reward_norm``);
    ``transport`` ``http``, ``grpc`` (then ``url``) or ``inprocess`` (None: ``http`` when
    ``url`` is given); ``group_size`` the rows of a group when ``reward_norm`` does not say
    (default: its ``group_size``); ``options``: ``ignore_token_ids`` and ``namespace`` for every
    call, the rest for the client. Checked when an actor is built."""
    from areal.trainer.ppo import actor as actor_module
    from areal.utils.functional import reward_overlong_penalty

    actor_class = actor_module.PPOActor
    original_init = _PATCHED.keep(actor_class, ("__init__", "_compute_advantages"))["__init__"]
    settings = dict(options)

    def __init__(self: Any, config: Any, engine: Any) -> None:
        original_init(self, config, engine)
        self.advantage_service = ServiceAdvantages(
            config, estimator, transport, url, group_size, **settings
        )

    def _compute_advantages(self: Any, data: dict[str, Any]) -> dict[str, Any]:
        return self.advantage_service.compute(self, data, reward_overlong_penalty)

    actor_class.__init__ = __init__
    actor_class._compute_advantages = _compute_advantages


def unpatch() -> None:
    """Restore AReaL's own ``PPOActor``."""
    _PATCHED.restore()


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`patch`'s arguments from ``ADVANTAGE_AREAL_ESTIMATOR`` (a preset name or a JSON
    estimator object; default ``grpo``), ``ADVANTAGE_AREAL_TRANSPORT``, ``ADVANTAGE_AREAL_URL``
    and ``ADVANTAGE_AREAL_OPTIONS`` (a JSON object: ``group_size`` and the options)."""
    return adapter.settings_from_env(env, "ADVANTAGE_AREAL", AReaLConfigError)


def setup() -> None:
    """:func:`patch` with settings from ``ADVANTAGE_AREAL_*`` variables."""
    patch(**settings_from_env())
