"""Runs in the AReaL environment (``areal_env.py``): AReaL's own ``PPOActor.compute_advantages``
on a synthetic batch of trajectories, once as AReaL ships it and once patched by
``advantage_client.integrations.areal`` (through :func:`setup`, settings from
``ADVANTAGE_AREAL_*``), for each case.

argv[1]: a JSON object: ``transports`` (``[name, url or null]`` each) and ``cases`` (each
``{"estimator", "reward_norm": NormConfig fields or null, "adv_norm": the same, "compare":
bool}``). Prints one JSON
object: AReaL's version, what construction said to bad settings, and per transport the batch
as the service saw it and per case the advantages on the loss positions (AReaL's next-token
layout), the adapter's and, where compared, AReaL's own.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from advantage_client.integrations import areal as adv_areal
from areal.api.cli_args import NormConfig, PPOActorConfig
from areal.trainer.ppo.actor import PPOActor
from step_support import construction_said, print_result

N_SAMPLES = 4
PROMPTS = 3
KL_CTL = 0.1


def make_config(reward_norm: dict[str, Any] | None, **changes: Any) -> PPOActorConfig:
    config = PPOActorConfig(
        kl_ctl=KL_CTL,
        reward_bias=-0.1,
        reward_scaling=2.0,
        reward_clip=1.5,
        overlong_reward_penalty=True,
        overlong_tokens=3,
        overlong_penalty_factor=0.5,
        max_new_tokens=9,
        mask_no_eos_with_zero=True,
        reward_norm=None if reward_norm is None else NormConfig(**reward_norm),
    )
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def config_of(spec: dict[str, Any]) -> PPOActorConfig:
    adv_norm = spec.get("adv_norm")
    return make_config(
        spec["reward_norm"], adv_norm=None if adv_norm is None else NormConfig(**adv_norm)
    )


def make_batch() -> list[dict[str, Any]]:
    """PROMPTS trajectories dicts of N_SAMPLES samples each (AReaL's workflow output): right
    padded prompt + response, one response of two turns (a gap in its loss mask), one without
    EOS (filling its row), one group of equal rewards."""
    g = torch.Generator().manual_seed(11)
    out = []
    for p in range(PROMPTS):
        prompt = torch.randint(3, 40, (3 + p,), generator=g)
        lengths = [2 + (p * 3 + s * 5) % 8 for s in range(N_SAMPLES)]
        width = len(prompt) + max(lengths)
        ids = torch.zeros(N_SAMPLES, width, dtype=torch.long)
        attention = torch.zeros(N_SAMPLES, width, dtype=torch.long)
        loss = torch.zeros(N_SAMPLES, width, dtype=torch.long)
        for s, length in enumerate(lengths):
            end = len(prompt) + length
            ids[s, : len(prompt)] = prompt
            ids[s, len(prompt) : end] = torch.randint(3, 40, (length,), generator=g)
            attention[s, :end] = 1
            loss[s, len(prompt) : end] = 1
            if p == 1 and s == 2 and length > 4:  # an observation inside the response
                loss[s, len(prompt) + 1 : len(prompt) + 3] = 0
        logprobs = -torch.rand(N_SAMPLES, width, generator=g) * loss
        ref_logp = -torch.rand(N_SAMPLES, width, generator=g)
        rewards = (
            torch.ones(N_SAMPLES)
            if p == 2
            else torch.tensor([float((p + s) % 3 == 0) + 0.3 * s for s in range(N_SAMPLES)])
        )
        out.append(
            {
                "input_ids": ids,
                "attention_mask": attention,
                "loss_mask": loss,
                "logprobs": logprobs,
                "ref_logp": ref_logp,
                "rewards": rewards,
            }
        )
    return out


def on_loss(result: list[dict[str, Any]], key: str) -> list[list[float]]:
    """Per sample (in batch order), ``key``'s values on its loss positions (next-token
    layout)."""
    rows = []
    for traj in result:
        for values, mask in zip(traj[key], traj["loss_mask"], strict=True):
            rows.append(values[mask.bool()].double().tolist())
    return rows


def seen_batch(base: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows as the service saw them, from AReaL itself: the tokens on the loss mask, the
    rewards after AReaL's penalty, bias, scaling and clip (its advantages without KL or
    normalisation), and AReaL's KL reward-to-go on each loss position (its advantages with the
    rewards scaled to 0)."""
    adv_areal.unpatch()
    scored = PPOActor(make_config(None, kl_ctl=0.0, mask_no_eos_with_zero=False), None)
    rewards = [
        row[0] for row in on_loss(scored.compute_advantages(copy.deepcopy(base)), "advantages")
    ]
    kl_only = PPOActor(make_config(None, reward_scaling=0.0), None)
    kl = on_loss(kl_only.compute_advantages(copy.deepcopy(base)), "advantages")
    tokens = [
        ids[mask.bool()].tolist()
        for traj in base
        for ids, mask in zip(traj["input_ids"], traj["loss_mask"], strict=True)
    ]
    # (AReaL's "no EOS": a row as long as the concatenated batch, its widest trajectory)
    width = max(traj["attention_mask"].shape[1] for traj in base)
    no_eos = [bool(m.sum() == width) for traj in base for m in traj["attention_mask"]]
    return {"tokens": tokens, "rewards": rewards, "kl_to_go": kl, "no_eos": no_eos}


def run_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": []}
    base = make_batch()
    for spec in cases:
        case: dict[str, Any] = dict(spec)
        if spec.get("compare"):
            adv_areal.unpatch()
            own = PPOActor(config_of(spec), None)
            case["own"] = on_loss(own.compute_advantages(copy.deepcopy(base)), "advantages")
        estimator = spec["estimator"]
        os.environ[adv_areal.ENV_ESTIMATOR] = (
            estimator if isinstance(estimator, str) else json.dumps(estimator)
        )
        adv_areal.setup()
        actor = PPOActor(config_of(spec), None)
        got = actor.compute_advantages(copy.deepcopy(base))
        case["service"] = on_loss(got, "advantages")
        case["sent"] = actor.advantage_service.estimator
        case["calls"] = len(actor.advantage_service.calls)
        out["cases"].append(case)
    out["batch"] = seen_batch(base)
    return out


def refusals() -> list[str]:
    """What the patched actor's construction says to bad settings."""
    said = []
    for estimator, reward_norm, changes in (
        ("ktea", {"mean_level": "group", "group_size": N_SAMPLES}, {}),
        ("rloo", {"mean_level": "group", "group_size": N_SAMPLES}, {}),
        ("grpo", None, {"discount": 0.99}),
        ({"outcome": {"name": "grpo", "std_scope": "none"}}, None, {}),
    ):
        adv_areal.patch(estimator, "inprocess")
        config = make_config(reward_norm, **changes)
        said.append(construction_said(adv_areal.AReaLConfigError, PPOActor, config, None))
    return said


def main() -> None:
    print_result("areal", adv_areal, run_cases, refusals)


if __name__ == "__main__":
    main()
