"""MaxRL: the outcome advantage of Maximum Likelihood Reinforcement Learning (Tajwar et al. 2026,
"Maximum Likelihood Reinforcement Learning", arXiv 2602.02710).

Reinforcement learning on a 0/1 verifier maximises the pass rate p(x); maximum likelihood
maximises log p(x), whose gradient is the RL gradient divided by p(x): hard prompts weigh more.
The paper's sample estimator with the group's own N rollouts replaces p(x) by the group's
success rate r_hat = K / N and keeps a control variate:

    a_i = (r_i - r_hat_g) / r_hat_g,    r_hat_g = mean of the group's rewards

Binary rewards, K of N correct: a correct rollout gets (N - K) / K and a wrong one -1 (their
sum over the group is 0); a group with K = 0 has no success to learn from and every a_i is 0,
and so does a group with K = N (r_i = r_hat).

Version: arXiv 2602.02710 (v1). No equation number is cited: the paper's text that could be
read (its abstract and the authors' project page) states the objective, log p(x) in place of
p(x), and the 1/p(x) reweighting of the gradient, but not the numbered estimator; the formula
above (the average over the successful rollouts, with the group's success rate as the control
variate) is the one ESTIMATORS.md and the issue that asked for MaxRL give, and was not checked
against the paper's equations. The
per-rollout advantage omits the estimator's 1/N factor, as GRPO's does: the trainer's loss
averages over the rollouts.

Cases the paper leaves open, and what this service does:

- continuous rewards: the paper derives the estimator for binary rewards only. For rewards
  r >= 0 the same formula, with r_hat the group's mean reward, is the plug-in estimate of the
  gradient of log E[r] (E[r grad log pi] / E[r]), which is what it computes; a negative reward
  has no such reading (the mean may be 0 or negative and flip every sign) and is a request
  error (422 ``invalid_value`` naming the reward). Send 0/1, not -1/+1.
- a group of one rollout: r_hat is the rollout's own reward, so a_i = 0 (K = N or K = 0). (verl's
  convention of mean 0 for a group of one is not used: it would divide by epsilon.)
- ``epsilon`` (default 0, the paper's estimator exactly) is added to r_hat in the denominator,
  as the authors' verl code does with 1e-6; a group with r_hat + epsilon = 0 gets 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..batch import RolloutBatch
from ..errors import RequestError
from .baselines import group_sum
from .registry import Param, register_outcome

PARAMS = (
    Param(
        "epsilon",
        float,
        0.0,
        "added to the group's mean reward in the denominator (0: the paper's estimator exactly)",
        minimum=0.0,
    ),
)


def success_rate(batch: RolloutBatch) -> torch.Tensor:
    """r_hat_g, the mean reward of each group (its success rate K / N for 0/1 rewards):
    float64 (G,)."""
    return group_sum(batch, batch.rewards.double()) / batch.group_sizes.double()


def maxrl_advantage(batch: RolloutBatch, epsilon: float = 0.0) -> torch.Tensor:
    """a_i = (r_i - r_hat_g) / (r_hat_g + epsilon), 0 where r_hat_g + epsilon = 0: float64 (B,).

    Rewards must be >= 0 (:func:`check_rewards`)."""
    r = batch.rewards.double()
    rate = success_rate(batch).index_select(0, batch.group_index)
    denominator = rate + epsilon
    centered = r - rate
    return torch.where(denominator > 0, centered / denominator, torch.zeros_like(r))


def check_rewards(batch: RolloutBatch, params: Mapping[str, Any]) -> None:
    """Refuse a negative reward: MaxRL divides by the group's success rate."""
    bad = torch.nonzero(batch.rewards < 0)
    if bad.numel():
        i = int(bad[0])
        raise RequestError(
            "invalid_value",
            f"reward is {float(batch.rewards[i])}; maxrl needs rewards >= 0 (it divides by the "
            "group's success rate: send 0/1, not -1/+1)",
            **batch.locate_rollout(i, "reward"),
        )


@register_outcome(
    "maxrl",
    formula="a_i = (r_i - r_hat_g) / (r_hat_g + eps), r_hat_g = mean_g r (K of N correct: "
    "(N - K) / K if correct, -1 if wrong, 0 if K = 0)",
    paper="Tajwar et al. 2026, Maximum Likelihood Reinforcement Learning, arXiv 2602.02710",
    params=PARAMS,
    check_batch=check_rewards,
)
def maxrl(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Maximum-likelihood RL: the centred reward divided by the group's success rate."""
    return maxrl_advantage(batch, params["epsilon"])
