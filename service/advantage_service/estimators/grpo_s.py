"""GRPO-S: Sequence-Level GRPO with entropy-shaped rewards (Tan et al., "GTPO and GRPO-S: Token and
Sequence-Level Reward Shaping with Policy Entropy", arXiv 2508.04349).

GTPO's dynamic entropy weighting at the sequence level: a rollout's entropy is its mean token
entropy H^_i = (1/T_i) sum_t H_it, and the shaped rewards are per rollout, separately for the
correct rollouts O+ (n+ of them with tokens) and the wrong ones O- (n-):

    correct (O+):  r^_i = alpha1 r_i + alpha2 n+ H^_i / sum_{k in O+} H^_k
    wrong (O-):    r^_i = -alpha1   - alpha2 n- (1/H^_i) / sum_{k in O-} (1/H^_k)

(a correct rollout that thought harder gains; a confidently wrong one loses more), normalised
per class over the group's rollouts, the other class's rollouts counting 0:

    a_i = (r^_i - mean(R^+)) / (std(R^+) + eps) for i in O+, likewise with R^- for i in O-

(std: the sample standard deviation over the group's rollouts). a_i is the rollout's scalar
advantage, on every one of its tokens. With alpha2 = 0 and 0/1 rewards it is GRPO's a_i.

Version, sources, parameters and the cases the paper leaves open are GTPO's (:mod:`.gtpo`):
arXiv 2508.04349v6; no equation number is cited (the stored text that could be read has the
abstract, introduction and Figure 1's caption, which confirm the per-sequence weighting by the
mean token entropy, not the method section's equations); a group without both classes (a
group of one among them) gets 0; all-zero mean entropies in O+ share equally, zero ones in O-
take the O- share among themselves; an empty rollout has no mean entropy and takes no share
(its r^_i is alpha1 r_i or -alpha1, and it is not counted in n+ or n-) but counts in the
normalisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..batch import RolloutBatch
from .gtpo import (
    PARAMS,
    Classes,
    clamp_entropy,
    normalise_per_class,
    outcome_rewards,
    split_classes,
)
from .registry import OutcomeOutput, register_outcome


def sequence_shares(
    batch: RolloutBatch, classes: Classes, entropy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(share, members), float64 (B,) each: each rollout's share of its class's entropy term
    (summing to 1 over the class's rollouts with tokens, 0 for an empty rollout): H^_i / sum H^
    in O+, (1/H^_i) / sum 1/H^ in O-, with the docstring's cases at 0; and the number of its
    class's rollouts with tokens in its group (n+ or n-)."""
    tokens = batch.lengths.double()
    mean_h = batch.rollout_sums(clamp_entropy(entropy)) / tokens.clamp(min=1.0)
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
    ones = torch.ones_like(reward)

    def centred_squares(mean: torch.Tensor) -> torch.Tensor:
        return (reward - mean).square()

    norm = normalise_per_class(batch, classes, reward, centred_squares, ones, epsilon)
    cg = classes.class_group
    advantage = (reward - norm.mean.index_select(0, cg)) * norm.scale.index_select(0, cg)
    return SequenceShaping(reward, advantage)


@register_outcome(
    "grpo_s",
    formula="r^_i = alpha1 r_i + alpha2 n+ H^_i / sum_O+ H^_k (correct), -alpha1 - alpha2 n- "
    "H^_i^-1 / sum_O- H^_k^-1 (wrong), H^_i the mean token entropy; a_i = (r^_i - mean) / "
    "(std + eps) per class over the group's rollouts",
    paper="Tan et al. 2025, GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with "
    "Policy Entropy, arXiv 2508.04349v6 (GRPO-S)",
    params=PARAMS,
    diagnostics=("grpo_s_reward",),
    requires=lambda params: {"entropy": "entropy"},
)
def grpo_s(batch: RolloutBatch, params: Mapping[str, Any]) -> OutcomeOutput:
    """Entropy-shaped rollout rewards of the correct and wrong rollouts, normalised per class."""
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
