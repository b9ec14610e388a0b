"""MaxRL: the outcome advantage of Maximum Likelihood Reinforcement Learning (Tajwar et al. 2026,
"Maximum Likelihood Reinforcement Learning", arXiv 2602.02710).

Reinforcement learning on a 0/1 verifier maximises the pass rate p(x); maximum likelihood
maximises log p(x), whose gradient is the RL gradient divided by p(x): hard prompts weigh more.
With the group's N rollouts, K of them correct, S_i the score function of rollout i:

    a_i = (r_i - r_hat_g) / r_hat_g,    r_hat_g = mean of the group's rewards (K / N)

Binary rewards: a correct rollout gets (N - K) / K and a wrong one -1 (their sum over the group
is 0); a group with K = 0 has no success to learn from and every a_i is 0, and so does a group
with K = N (r_i = r_hat).

Version: arXiv 2602.02710 v1, read in the authors' preprint PDF of 4 February 2026 (the one
their project page links; equation and section numbers are that PDF's). Section 4.1, Eq. (9):
the estimator averages the scores of the successful rollouts only, g_N(x) = (1/K) sum_i r_i S_i
(0 when K = 0), unbiased for the gradient of the maximum-likelihood objective truncated at
order N. Section 4.2, Eq. (10): with the zero-mean control variate (1/N) sum_i S_i,
g~_N(x) = sum_i (r_i / K - 1/N) S_i, the first term taken as 0 when K = 0. Section 4.3: "We
adopt the variance-reduced formulation in Eq. (10), and drop both terms when K = 0 [...]
Concretely, the advantage is normalized by the per-task mean reward". Algorithm 1, line 8:
g(x) = (1 / (N r_hat(x))) sum_j (r_j - r_hat(x)) S_j if r_hat(x) > 0, else 0 (line 7:
r_hat(x) = (1/N) sum_j r_j). Since N r_hat = K, a_i / N = r_i / K - 1/N is Eq. (10)'s
coefficient of S_i: the per-rollout advantage omits the 1/N factor, as GRPO's does, for the
trainer's loss averages over the rollouts. Appendix F writes the same advantage as
A_i = (r_i - mean) / (mean + eps), eps = 1e-6 in the authors' runs.

Cases the paper leaves open or settles otherwise, and what this service does:

- continuous rewards: the paper assumes binary rewards; its Conclusion (Section 8) says the
  work "does not extend directly to continuous or arbitrarily valued rewards". For rewards
  r >= 0 the same formula, with r_hat the group's mean reward, is the plug-in estimate of the
  gradient of log E[r] (E[r grad log pi] / E[r]), which is what it computes; a negative reward
  has no such reading (the mean may be 0 or negative and flip every sign) and is a request
  error (422 ``invalid_value`` naming the reward). Send 0/1, not -1/+1.
- a group of one rollout (N = 1): Algorithm 1 gives 0 (r_1 - r_hat = 0, or r_hat = 0), and so
  does this service. The authors' verl code takes the mean of a group of one as 0 and would
  give r / 1e-6; that is not copied.
- ``epsilon`` (default 0: Eq. (10) and Algorithm 1 exactly) is added to r_hat in the
  denominator, as Appendix F and the authors' code do with 1e-6 (send ``epsilon: 1e-6`` to
  match their runs); a group with r_hat + epsilon = 0 gets 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..batch import RolloutBatch
from ..batch.validation import refuse_first_rollout
from .baselines import group_sum
from .registry import Param, register_outcome

PARAMS = (
    Param(
        "epsilon",
        float,
        0.0,
        "added to the group's mean reward in the denominator (0: the paper's Eq. (10) "
        "exactly; its runs add 1e-6)",
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
    refuse_first_rollout(
        batch,
        batch.rewards < 0,
        batch.rewards,
        "reward",
        "maxrl needs rewards >= 0 (it divides by the group's success rate: send 0/1, not -1/+1)",
    )


@register_outcome(
    "maxrl",
    formula="a_i = (r_i - r_hat_g) / (r_hat_g + eps), r_hat_g = mean_g r (K of N correct: "
    "(N - K) / K if correct, -1 if wrong, 0 if K = 0)",
    paper="Tajwar et al. 2026, Maximum Likelihood Reinforcement Learning, arXiv 2602.02710 "
    "(Eq. (10), Algorithm 1)",
    params=PARAMS,
    check_batch=check_rewards,
)
def maxrl(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Maximum-likelihood RL: the centred reward divided by the group's success rate."""
    return maxrl_advantage(batch, params["epsilon"])
