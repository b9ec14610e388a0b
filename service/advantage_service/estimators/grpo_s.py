"""GRPO-S: Sequence-Level GRPO with entropy-shaped rewards (Tan et al., "GTPO and GRPO-S: Token and
Sequence-Level Reward Shaping with Policy Entropy", arXiv 2508.04349).

GTPO's dynamic entropy weighting at the sequence level: a rollout's entropy is its mean token
entropy H^_i = (1/T_i) sum_t H_it (Eq. 8), and the shaped rewards are per rollout, separately
for the correct rollouts O+ (n+ of them with tokens) and the wrong ones O- (n-), Eq. 9:

    correct (O+):  r^_i = alpha1 r_i + alpha2 n+ H^_i / sum_{k in O+} H^_k
    wrong (O-):    r^_i = -alpha1   - alpha2 n- (1/H^_i) / sum_{k in O-} (1/H^_k)

(a correct rollout that thought harder gains; a confidently wrong one loses more), normalised
as GRPO's rewards are, over the group's rollouts of both classes together:

    a_i = (r^_i - mean(r^)) / (std(r^) + eps)

(std: the sample standard deviation over the group's rollouts). a_i is the rollout's scalar
advantage, on every one of its tokens. With alpha2 = 0 and 0/1 rewards it is GRPO's a_i.

Version and sources: those of GTPO (:mod:`.gtpo`): arXiv 2508.04349v6, whose method section
could not be read from here; Eq. 8 and 9 as public re-implementations of the v5 equations quote
them, and the normalisation as they compute it (per group, "analogous to GRPO"); reviewers of
the v5 submission confirm the inverse-entropy weighting of O- over its m rollouts. The stored v6
text confirms the weighting of a sequence by its mean token entropy (Figure 1). Parameters
(alpha1 = beta1 = 1, alpha2 = beta2 = 0.1 in the paper's notation) and the cases the paper
leaves open are GTPO's: a group without both classes (a group of one among them) gets 0;
all-zero mean entropies in O+ share equally, zero ones in O- take the O- share among
themselves; an empty rollout has no mean entropy and takes no share (its r^_i is alpha1 r_i or
-alpha1, and it is not counted in n+ or n-) but counts in the normalisation. The paper's
geometric-mean variant (its Section 2.4) is not offered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..batch import RolloutBatch
from .baselines import divide_by_spread, group_mean_std
from .gtpo import PARAMS, Classes, clamp_entropy, outcome_rewards, split_classes
from .registry import OutcomeOutput, register_outcome


def entropy_sums(batch: RolloutBatch, entropy: torch.Tensor) -> torch.Tensor:
    """Each rollout's float64 sum of its entropies, one below 0 (a trainer's rounding) taken as
    0: float64 (B,). On the CPU one compiled pass (numpy's ``reduceat`` and a pass for the
    minimum cost about ten times as much); elsewhere torch's."""
    if entropy.device.type != "cpu" or batch.num_tokens == 0:
        return batch.rollout_sums(clamp_entropy(entropy))
    from . import kernels  # (numba is imported when a compiled loop first runs)

    h = entropy.float().contiguous().numpy()
    return torch.from_numpy(kernels.segment_sums_nonnegative(h, batch.offsets.numpy()))


def sequence_shares(
    batch: RolloutBatch, classes: Classes, entropy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(share, members), float64 (B,) each: each rollout's share of its class's entropy term
    (summing to 1 over the class's rollouts with tokens, 0 for an empty rollout): H^_i / sum H^
    in O+, (1/H^_i) / sum 1/H^ in O-, with the docstring's cases at 0; and the number of its
    class's rollouts with tokens in its group (n+ or n-)."""
    tokens = batch.lengths.double()
    mean_h = entropy_sums(batch, entropy) / tokens.clamp(min=1.0)
    has_tokens = batch.lengths > 0
    cg = classes.class_group
    num_cg = 2 * batch.num_groups
    v = torch.where(classes.correct, mean_h, mean_h.reciprocal())
    v = torch.where(has_tokens, v, torch.zeros_like(v))
    total = torch.zeros(num_cg, dtype=torch.float64, device=v.device).index_add_(0, cg, v)
    members = torch.zeros(num_cg, dtype=torch.float64, device=v.device)
    members.index_add_(0, cg, has_tokens.double())
    # O+ where every mean entropy is 0: equal shares.
    flat = (total == 0) & (members > 0)
    flat[batch.num_groups :] = False
    v = torch.where(flat.index_select(0, cg) & has_tokens, torch.ones_like(v), v)
    total = torch.where(flat, members, total)
    # O- where some mean entropy is 0 (1/0): those share.
    certain = torch.isinf(total)
    zero = torch.isinf(v).double()
    zeros = torch.zeros_like(total).index_add_(0, cg, zero)
    v = torch.where(certain.index_select(0, cg), zero, v)
    total = torch.where(certain, zeros, total)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return v / safe.index_select(0, cg), members.index_select(0, cg)


class SequenceShaping(NamedTuple):
    """GRPO-S's result, float64 (B,) each: the shaped reward r^_i and the advantage a_i."""

    reward: torch.Tensor
    advantage: torch.Tensor


def grpo_s_advantage(
    batch: RolloutBatch,
    entropy: torch.Tensor,
    *,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    correct_threshold: float = 0.0,
    epsilon: float = 1e-6,
) -> SequenceShaping:
    """GRPO-S's shaped rollout rewards and advantages (the module's formulas).

    entropy: H_it (nats), (N,)."""
    classes = split_classes(batch, correct_threshold)
    share, members = sequence_shares(batch, classes, entropy)
    sign = torch.where(classes.correct, 1.0, -1.0).double()
    reward = outcome_rewards(batch, classes, alpha1) + sign * alpha2 * members * share
    # As GRPO over the shaped rewards; a group without contrast (or of one) gets 0.
    mean, std = group_mean_std(batch, reward)
    group = batch.group_index
    d = reward - mean.index_select(0, group)
    a = divide_by_spread(d, std.index_select(0, group) + epsilon)
    advantage = torch.where(classes.contrast.index_select(0, group), a, torch.zeros_like(a))
    return SequenceShaping(reward, advantage)


@register_outcome(
    "grpo_s",
    formula="r^_i = alpha1 r_i + alpha2 n+ H^_i / sum_O+ H^_k (correct), -alpha1 - alpha2 n- "
    "H^_i^-1 / sum_O- H^_k^-1 (wrong), H^_i the mean token entropy; a_i = (r^_i - mean) / "
    "(std + eps) over the group's rollouts",
    paper="Tan et al. 2025, GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with "
    "Policy Entropy, arXiv 2508.04349v6 (GRPO-S)",
    params=PARAMS,
    diagnostics=("grpo_s_reward",),
    requires=lambda params: {"entropy": "entropy"},
)
def grpo_s(batch: RolloutBatch, params: Mapping[str, Any]) -> OutcomeOutput:
    """Entropy-shaped rollout rewards of the correct and wrong rollouts, normalised per group."""
    assert batch.entropy is not None  # by `requires`
    shaping = grpo_s_advantage(
        batch,
        batch.entropy,
        **{k: params[k] for k in ("alpha1", "alpha2", "correct_threshold", "epsilon")},
    )
    return OutcomeOutput(
        shaping.advantage,
        diagnostics={"grpo_s_reward": lambda: batch.per_token(shaping.reward.float())},
    )
