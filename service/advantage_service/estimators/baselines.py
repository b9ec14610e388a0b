"""Outcome baselines: one scalar advantage a_i per rollout from the group's rewards.

Each reproduces verl's ``core_algos`` estimator of the same name (rloo: the vectorized variant).
Group statistics are segment sums over ``group_index``; a group of one rollout has mean 0 and
std 1 (verl's convention). All functions return float64 (B,).

GRPO's scaling parameters say where its baseline and its standard deviation are taken:
``mean_scope`` and ``std_scope`` (the group, the request, or none), ``leave_one_out``,
``std_unbiased``, ``std_center`` and ``epsilon``. They cover TRL's ``scale_rewards`` (group:
the defaults; batch: ``std_scope: "request"``; none: ``std_scope: "none"``) and AReaL 1.0.4's
``NormConfig`` (``areal/utils/data.py``, ``Normalization``: ``mean_level``, ``mean_leave1out``,
``std_level``, ``std_unbiased``, ``eps``; its std is taken about the mean it subtracted,
``std_center: "baseline"``). "The request" is each request of a merged batch
(``batch.segments``), never the merged batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..batch import RolloutBatch
from .registry import Param, register_outcome

NORM_PARAMS = (
    Param("norm_by_std", bool, True, "divide by the group's sample standard deviation"),
    Param("epsilon", float, 1e-6, "added to the standard deviation", minimum=0.0),
)
SCOPES = ("group", "request", "none")
STD_CENTERS = ("mean", "baseline")
ZERO_SIGNAL = ("keep", "zero")
GRPO_PARAMS = (
    *NORM_PARAMS,
    Param(
        "std_scope",
        str,
        "group",
        "the rewards the standard deviation is taken over: the group's, all of the request's "
        "(TRL's scale_rewards='batch', AReaL's std_level='batch'), or none (no division: "
        "TRL's scale_rewards='none', as norm_by_std false); a request merged with others keeps "
        "its own; a group or request of one rollout has std 1",
        choices=SCOPES,
    ),
    Param(
        "mean_scope",
        str,
        "group",
        "the rewards the baseline (the mean subtracted) is taken over: the group's, all of the "
        "request's (AReaL's mean_level='batch'), or none (baseline 0); a group or request of "
        "one rollout has mean 0",
        choices=SCOPES,
    ),
    Param(
        "leave_one_out",
        bool,
        False,
        "the baseline of rollout i leaves r_i out: the mean of the other rewards of its scope "
        "(AReaL's mean_leave1out; 0 for a scope of one)",
    ),
    Param(
        "std_unbiased",
        bool,
        True,
        "the sample standard deviation (divides by n - 1); false: the population one (by n)",
    ),
    Param(
        "std_center",
        str,
        "mean",
        "what the deviations are taken from: each std scope's own mean of the rewards (GRPO, "
        "TRL), or the baseline each rollout had subtracted (AReaL's Normalization: 0 with "
        "mean_scope 'none', the other rewards' mean with leave_one_out); the same when both "
        "scopes agree and leave_one_out is off",
        choices=STD_CENTERS,
    ),
    Param(
        "zero_signal",
        str,
        "keep",
        "a group whose rollouts all have the same reward (the summary's zero_signal_groups): "
        "'keep' gives it what the formula gives; 'zero' gives every token of it advantage 0, "
        "terms and whitening included (DAPO's and TRL's behaviour)",
        choices=ZERO_SIGNAL,
    ),
)

GRPO_DEFAULTS = {p.name: p.default for p in GRPO_PARAMS}


def group_sum(batch: RolloutBatch, values: torch.Tensor) -> torch.Tensor:
    """(G,) sums of per-rollout ``values`` (B,) over each group."""
    out = torch.zeros(batch.num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, batch.group_index, values)


def group_mean_std(
    batch: RolloutBatch, values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (mean, sample std) of per-rollout ``values`` (default: the rewards), float64
    (G,); (0, 1) for a group of one."""
    r = batch.rewards.double() if values is None else values.double()
    n = batch.group_sizes.double()
    mean = group_sum(batch, r) / n
    # Two passes (deviations from the mean) keep the variance exact for large rewards.
    sq = group_sum(batch, (r - mean[batch.group_index]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    single = batch.group_sizes == 1
    return mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)


def request_std(batch: RolloutBatch) -> torch.Tensor:
    """Each rollout's request's sample std of the rewards, float64 (B,): of the whole batch, or
    of each request of a merged batch; 1 for a request of one rollout (as for a group of one)."""
    r = batch.rewards.double()
    segment, count = batch.request_of_rollout()
    # The same sums (index_add_, in rollout order) alone and merged: the same std bit for bit.
    n = scope_sum(segment, count, torch.ones_like(r))
    mean = scope_sum(segment, count, r) / n.clamp(min=1)
    sq = scope_sum(segment, count, (r - mean[segment]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp(min=1)).masked_fill(n == 1, 1.0)
    return std[segment]


def divide_by_spread(values: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """values / spread, with 0 / 0 = 0: with epsilon 0, a group of equal rewards has no spread
    and no deviation from its mean, and gets no advantage (not NaN)."""
    return torch.where(spread > 0, values / spread, torch.zeros_like(values))


def centered(batch: RolloutBatch) -> torch.Tensor:
    """r_i - mean_g, float64 (B,)."""
    mean, _ = group_mean_std(batch)
    return batch.rewards.double() - mean[batch.group_index]


def scope_index(batch: RolloutBatch, scope: str) -> tuple[torch.Tensor, int]:
    """Each rollout's scope (int64 (B,)) and the number of scopes: its group, or its request
    (each request of a merged batch)."""
    if scope == "group":
        return batch.group_index, batch.num_groups
    return batch.request_of_rollout()


def scope_sum(index: torch.Tensor, count: int, values: torch.Tensor) -> torch.Tensor:
    """(count,) sums of ``values`` (B,) over each scope, in rollout order (the same sums alone
    and merged: the same bits)."""
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)


def scope_baseline(batch: RolloutBatch, scope: str, leave_one_out: bool) -> torch.Tensor:
    """Each rollout's baseline b_i, float64 (B,): the mean reward of its scope (of the scope's
    other rollouts with ``leave_one_out``); 0 for a scope of one, and for scope ``none``."""
    r = batch.rewards.double()
    if scope == "none":
        return torch.zeros_like(r)
    index, count = scope_index(batch, scope)
    n = scope_sum(index, count, torch.ones_like(r))[index]
    total = scope_sum(index, count, r)[index]
    if leave_one_out:
        return torch.where(n > 1, (total - r) / (n - 1).clamp(min=1), torch.zeros_like(r))
    return torch.where(n > 1, total / n, torch.zeros_like(r))


def scope_std(
    batch: RolloutBatch, scope: str, deviations: torch.Tensor | None, unbiased: bool
) -> torch.Tensor:
    """Each rollout's std scope's standard deviation, float64 (B,): of the rewards about the
    scope's mean (``deviations`` None), or the root of the summed squared ``deviations`` (B,)
    over the scope; divided by n - 1 (``unbiased``) or n; 1 for a scope of one."""
    r = batch.rewards.double()
    index, count = scope_index(batch, scope)
    n = scope_sum(index, count, torch.ones_like(r))
    if deviations is None:
        mean = scope_sum(index, count, r) / n.clamp(min=1)
        deviations = r - mean[index]
    sq = scope_sum(index, count, deviations**2)
    std = torch.sqrt(sq / ((n - 1) if unbiased else n).clamp(min=1))
    return std.masked_fill(n <= 1, 1.0)[index]


def grpo_spread(
    batch: RolloutBatch, params: Mapping[str, Any], baseline: torch.Tensor
) -> torch.Tensor:
    """The standard deviation GRPO divides rollout i by, float64 (B,) (``std_scope`` not
    ``none``)."""
    scope, unbiased = params["std_scope"], params["std_unbiased"]
    if params["std_center"] == "baseline":
        return scope_std(batch, scope, batch.rewards.double() - baseline, unbiased)
    # The rewards about their own mean: GRPO's and TRL's std, computed as it always was.
    if unbiased and scope == "group":
        return group_mean_std(batch)[1][batch.group_index]
    if unbiased:
        return request_std(batch)
    return scope_std(batch, scope, None, unbiased)


@register_outcome(
    "grpo",
    formula="a_i = (r_i - b_i) / (std + eps), b_i the mean of the group's (or the request's) "
    "rewards, std the group's (std_g) or the request's",
    paper="Shao et al. 2024, DeepSeekMath (GRPO)",
    params=GRPO_PARAMS,
)
def grpo(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Group-normalised reward: the GRPO outcome advantage."""
    # (a caller of the function itself may pass only the parameters it sets)
    params = {**GRPO_DEFAULTS, **params}
    if params["mean_scope"] == "group" and not params["leave_one_out"]:
        mean, _ = group_mean_std(batch)
        baseline = mean[batch.group_index]
    else:
        baseline = scope_baseline(batch, params["mean_scope"], params["leave_one_out"])
    a = batch.rewards.double() - baseline
    if params["norm_by_std"] and params["std_scope"] != "none":
        spread = grpo_spread(batch, params, baseline)
        a = divide_by_spread(a, spread + params["epsilon"])
    if params["zero_signal"] == "zero":
        # (the pipeline zeroes these groups' tokens after the terms too; here for a caller of
        # the outcome alone)
        a = a.masked_fill(batch.zero_signal[batch.group_index], 0.0)
    return a


@register_outcome(
    "dr_grpo",
    formula="a_i = r_i - mean_g",
    paper="Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO)",
)
def dr_grpo(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """GRPO without the division by the group's standard deviation."""
    return centered(batch)


@register_outcome(
    "rloo",
    formula="a_i = (n r_i - sum_g r) / (n - 1); 0 for a group of one",
    paper="Ahmadian et al. 2024, Back to Basics: REINFORCE Leave-One-Out",
)
def rloo(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Reward minus the mean of the other rollouts of the group."""
    r = batch.rewards.double()
    n = batch.group_sizes.double()[batch.group_index]
    total = group_sum(batch, r)[batch.group_index]
    return torch.where(n > 1, (n * r - total) / (n - 1).clamp(min=1), torch.zeros_like(r))


@register_outcome(
    "reinforce",
    formula="a_i = r_i",
    paper="Williams 1992, REINFORCE",
)
def reinforce(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """The raw reward, no baseline."""
    return batch.rewards.double()


@register_outcome(
    "reinforce_pp_baseline",
    formula="a_i = r_i - mean_g, then whitening over the request's tokens (on by default)",
    paper="Hu 2025, REINFORCE++ (with group baseline)",
    whiten_default=True,
)
def reinforce_pp_baseline(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Group-mean baseline; the pipeline whitens the token advantages by default."""
    return centered(batch)


@register_outcome(
    "opo",
    formula="a_i = r_i - sum_j T_j r_j / sum_j T_j (length-weighted group mean)",
    paper="Hao et al. 2025, On-Policy RL with Optimal Reward Baseline (OPO)",
)
def opo(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Reward minus the length-weighted mean reward of the group."""
    r = batch.rewards.double()
    t = batch.lengths.double()
    weighted = group_sum(batch, t * r)
    total_len = group_sum(batch, t)
    mean, _ = group_mean_std(batch)
    # A group of only empty rollouts has no length weights: fall back to the plain mean.
    b = torch.where(total_len > 0, weighted / total_len.clamp(min=1), mean)
    b = b.masked_fill(batch.group_sizes == 1, 0.0)
    return r - b[batch.group_index]


@register_outcome(
    "gpg",
    formula="a_i = alpha (r_i - mean_g), alpha = B / max(1, #{i : r_i != 0})",
    paper="Chu et al. 2025, GPG: A Simple and Strong Reinforcement Learning Baseline",
)
def gpg(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Group-mean baseline scaled up by the share of rollouts that carry a reward."""
    segment = batch.segment_of_rollout()
    if segment is None:
        nonzero = int((batch.rewards != 0).sum())
        alpha = batch.num_rollouts / max(1, nonzero)
        return alpha * centered(batch)
    # Requests merged into one batch: B and the count are each request's own (float64 division,
    # as Python's above: the same alpha bit for bit).
    count = len(batch.spans())
    sizes = torch.bincount(segment, minlength=count).double()
    nonzero_per = torch.bincount(segment, (batch.rewards != 0).double(), minlength=count)
    alpha_per = sizes / nonzero_per.clamp(min=1.0)
    return alpha_per.index_select(0, segment) * centered(batch)


@register_outcome(
    "grpo_passk",
    formula="best rollout: (r_max - r_second) / (std_g + eps); every other rollout: 0",
    paper="Chen et al. 2025, Pass@k Training for Adaptively Balancing Exploration",
    params=NORM_PARAMS,
    min_group_size=2,
)
def grpo_passk(batch: RolloutBatch, params: Mapping[str, Any]) -> torch.Tensor:
    """Only the group's best rollout is credited, by its margin over the runner-up."""
    r = batch.rewards.double()
    g, b = batch.num_groups, batch.num_rollouts
    idx = torch.arange(b, device=r.device)
    best_value = torch.full((g,), -torch.inf, dtype=r.dtype, device=r.device)
    best_value = best_value.scatter_reduce(0, batch.group_index, r, "amax")
    # Ties go to the lowest rollout index: the smallest index among those at the maximum.
    at_max = r == best_value[batch.group_index]
    candidate = torch.where(at_max, idx, torch.full_like(idx, b))
    best_index = torch.full((g,), b, dtype=idx.dtype, device=r.device)
    best_index = best_index.scatter_reduce(0, batch.group_index, candidate, "amin")
    is_best = idx == best_index[batch.group_index]
    others = torch.where(is_best, torch.full_like(r, -torch.inf), r)
    second = torch.full((g,), -torch.inf, dtype=r.dtype, device=r.device)
    second = second.scatter_reduce(0, batch.group_index, others, "amax")
    margin = best_value - second
    if params["norm_by_std"]:
        _, std = group_mean_std(batch)
        margin = divide_by_spread(margin, std + params["epsilon"])
    return torch.where(is_best, margin[batch.group_index], torch.zeros_like(r))
