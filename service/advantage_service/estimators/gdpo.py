"""GDPO: Group reward-Decoupled normalization Policy Optimization (Liu et al. 2026, arXiv
2601.05242), the outcome for several named rewards per rollout (``reward_components``: a format
reward, an accuracy reward, ...).

GRPO normalises the sum of the rewards, where the widest reward drowns the others; GDPO
normalises each component k within its group first, sums them with weights w_k, then normalises
the sum over the whole request:

    A_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps_g)        (std: unbiased, over the group)
    S_i  = sum_k w_k A_ik
    a_i  = the request's normalisation of S_i

``normalization`` chooses whose formula, each exact to the library's own code:

- ``"verl"`` (default): verl 0.9.1 ``compute_gdpo_outcome_advantage``
  (``verl/trainer/ppo/core_algos.py:362-468``): eps_g = 1e-6; a group of one has mean 0 and
  std 1 (``compute_grpo_outcome_advantage``'s convention), so A = r / (1 + 1e-6); then
  ``masked_whiten(S, response_mask)`` (``verl/utils/torch_functional.py:294-346``) over the
  request's tokens, every token of rollout i carrying S_i: with T_i its tokens and
  N = sum_i T_i,

      mean = sum_i T_i S_i / (N + 1e-8)
      var  = sum_i T_i (S_i - mean)^2 / (N + 1e-8) * N / (N - 1)
      a_i  = (S_i - mean) / sqrt(var + 1e-8)

  (verl raises for N = 1; here a request of one token gets 0).
- ``"trl"``: TRL 1.16 ``GRPOTrainer`` with ``multi_objective_aggregation="normalize_then_sum"``
  (``trl/trainer/grpo_trainer.py:2790-2800``, ``nanstd`` in ``trl/trainer/utils.py:1021``):
  eps_g = 1e-4; a component that fewer than two rollouts of the group scored has no std (TRL's
  ``nanstd`` is NaN there, and ``nansum`` drops it) and adds 0; then over the request's
  rollouts, with C the rollouts that scored any component,

      a_i = (S_i - mean_C(S)) / (std_C(S) + 1e-4)        (std unbiased; 0 for C < 2)

A missing value (null, NaN) of a component is left out of that component's group statistics
and adds nothing to S_i (TRL's None rewards; verl has no missing values). A rollout with no
value of any component is left out of the request's statistics and gets 0, as TRL's
unscorable completions. For the verl formula the group-of-one convention applies to a
component that one rollout of the group scored. Weights: ``weights`` maps a component name to
w_k, 1 for a name it lacks (verl's ``gdpo_reward_weights``, TRL's ``reward_weights``).

"The request" is the request the client sent, never a batch the scheduler merged: the final
normalisation runs per segment of a merged batch (``batch.segments``), with the same sums in
the same order as alone, so that a request's answer does not depend on its neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from advantage_contract.fields import (
    MAX_COMPONENT_NAME_LENGTH,
    MAX_REWARD_COMPONENTS,
    REWARD_COMPONENTS_FIELD,
)

from ..batch import RolloutBatch
from ..errors import RequestError, shown
from .baselines import group_sum
from .registry import Param, finite_number, register_outcome

# Each library's epsilon added to a component's group std, and the variance floor of verl's
# masked_whiten / the std floor of TRL's batch normalisation.
VERL_GROUP_EPS = 1e-6
VERL_WHITEN_EPS = 1e-8
TRL_EPS = 1e-4
NORMALIZATIONS = ("verl", "trl")


@dataclass(frozen=True)
class WeightsParam(Param):
    """A map of reward component name -> finite number (the registry's kinds are scalars and
    lists of strings: a map needs its own check)."""

    def coerce(self, value: Any, where: str) -> Any:
        if not isinstance(value, Mapping):
            raise RequestError(
                "invalid_parameter",
                f"{where} must be an object of component name -> number, got {shown(value)}",
                field=where,
            )
        if len(value) > self.max_items:
            raise RequestError(
                "out_of_range",
                f"{where} has {len(value)} components; the most is {self.max_items}",
                field=where,
            )
        out: dict[str, float] = {}
        for name, weight in value.items():
            if not isinstance(name, str) or not name or len(name) > self.max_length:
                raise RequestError(
                    "out_of_range",
                    f"{where} names must be non-empty and at most {self.max_length} "
                    f"characters, got {shown(name)}",
                    field=where,
                )
            out[name] = finite_number(weight, f"{where}.{name}")
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": "object",
            "default": self.default,
            "description": self.doc,
            "nullable": self.nullable,
        }


PARAMS = (
    WeightsParam(
        "weights",
        dict,
        {},
        "reward component name -> weight w_k of its normalised reward in the sum (1 for a "
        "component it does not name; verl's gdpo_reward_weights, TRL's reward_weights)",
        max_items=MAX_REWARD_COMPONENTS,
        max_length=MAX_COMPONENT_NAME_LENGTH,
    ),
    Param(
        "normalization",
        str,
        "verl",
        "whose formula: 'verl' (per group eps 1e-6, a group of one mean 0 std 1, then the sum "
        "whitened over the request's tokens as masked_whiten) or 'trl' (per group eps 1e-4, "
        "then the sum normalised over the request's rollouts, eps 1e-4, nan-aware)",
        choices=NORMALIZATIONS,
    ),
)


def check_components(batch: RolloutBatch, params: Mapping[str, Any]) -> None:
    """A request without reward components, or weights naming one it lacks, is refused."""
    if not batch.reward_components:
        raise RequestError(
            "missing_input",
            "outcome baseline 'gdpo' needs reward_components on the rollouts (several named "
            'rewards per rollout, e.g. {"format": 1.0, "accuracy": 0.0})',
            field=REWARD_COMPONENTS_FIELD,
        )
    for name in params["weights"]:
        if name not in batch.reward_components:
            raise RequestError(
                "invalid_parameter",
                f"estimator.outcome.weights names {shown(name)}, which no rollout of the "
                f"request has; its components: {sorted(batch.reward_components)}",
                field=f"estimator.outcome.weights.{name}",
            )


def component_advantage(
    batch: RolloutBatch, values: torch.Tensor, normalization: str
) -> torch.Tensor:
    """A_ik of one component, float64 (B,): (r - mean_g) / (std_g + eps) over the rollouts of
    the group that have a value (NaN: none); 0 where the rollout has none."""
    present = ~torch.isnan(values)
    r = torch.where(present, values.double(), torch.zeros((), dtype=torch.float64))
    gi = batch.group_index
    n = group_sum(batch, present.double())
    mean = group_sum(batch, r) / n.clamp(min=1)
    deviation = torch.where(present, r - mean[gi], torch.zeros((), dtype=torch.float64))
    std = torch.sqrt(group_sum(batch, deviation**2) / (n - 1).clamp(min=1))
    if normalization == "verl":
        lone = n == 1  # verl's group of one: mean 0, std 1
        mean, std = mean.masked_fill(lone, 0.0), std.masked_fill(lone, 1.0)
        a = (r - mean[gi]) / (std[gi] + VERL_GROUP_EPS)
    else:
        a = torch.where(n[gi] >= 2, (r - mean[gi]) / (std[gi] + TRL_EPS), 0.0)
    return torch.where(present, a, torch.zeros((), dtype=torch.float64))


def _segment_sum(values: torch.Tensor, segment: torch.Tensor, count: int) -> torch.Tensor:
    """(S,) sums of ``values`` (B,) over each request, in rollout order (the same bits alone
    and merged)."""
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    return out.index_add_(0, segment, values)


def request_normalized(
    batch: RolloutBatch, total: torch.Tensor, scored: torch.Tensor, normalization: str
) -> torch.Tensor:
    """a_i: the weighted sums ``total`` (float64 (B,)) normalised over each request, the
    rollouts ``scored`` (bool (B,)) counted; 0 for the others."""
    segment, count = batch.request_of_rollout()
    zero = torch.zeros((), dtype=torch.float64)
    if normalization == "verl":
        # Each rollout's value stands for its tokens: masked_whiten's token statistics.
        weight = torch.where(scored, batch.lengths.double(), zero)
        floor = VERL_WHITEN_EPS
    else:
        weight = scored.double()
        floor = 0.0
    n = _segment_sum(weight, segment, count)
    mean = _segment_sum(weight * total, segment, count) / (n + floor)
    centered = total - mean[segment]
    square = _segment_sum(weight * centered**2, segment, count)
    if normalization == "verl":
        var = square / (n + floor) * n / (n - 1).clamp(min=1)
        a = centered / torch.sqrt(var[segment] + VERL_WHITEN_EPS)
    else:
        std = torch.sqrt(square / (n - 1).clamp(min=1))
        a = centered / (std[segment] + TRL_EPS)
    return torch.where(scored & (n[segment] >= 2), a, zero)


@register_outcome(
    "gdpo",
    formula="A_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps); a_i = the request's "
    "normalisation of sum_k w_k A_ik (verl: whitened over its tokens; trl: over its rollouts)",
    paper="Liu et al. 2026, GDPO: Group reward-Decoupled Normalization Policy Optimization",
    params=PARAMS,
    check_batch=check_components,
)
def gdpo(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Each reward component normalised within its group, weighted and summed, normalised over
    the request."""
    normalization = params["normalization"]
    weights = params["weights"]
    total = torch.zeros(batch.num_rollouts, dtype=torch.float64, device=batch.device)
    scored = torch.zeros(batch.num_rollouts, dtype=torch.bool, device=batch.device)
    # (name order: the same sum whatever order the request gave its components in)
    for name in sorted(batch.reward_components):
        values = batch.reward_components[name]
        scored |= ~torch.isnan(values)
        total += weights.get(name, 1.0) * component_advantage(batch, values, normalization)
    return request_normalized(batch, total, scored, normalization)
