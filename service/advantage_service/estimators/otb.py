"""OTB: the optimal token baseline (Li et al. 2026, arXiv 2602.07078; verl
``optimal_token_baseline``).

A per-token outcome baseline: for group g and position t, B_gt = sum_i G_it W_it / (sum_i W_it +
eps) over the group's rollouts that reach t, where W_it = sum_{j <= t} w_ij accumulates the
path-variance proxy w = 1 - 2 pi + sum_v pi_v^2 (times rho^2 with truncated importance weights).
Rollouts whose path so far carried more variance weigh more in the baseline of position t.

verl loops over the groups in Python on a padded batch. Here (group, position) pairs are dense
keys over the flat batch (the group's base plus t, for t below the group's longest length), so
the per-position sums of every group are two float64 ``index_add_`` scatters: no sort, and no
loop over groups, rollouts or tokens. The cumulative W restarts at each rollout (see
:func:`segment_cumsum`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..batch import RolloutBatch, repeat_runs
from .registry import OutcomeOutput, Param, register_outcome

# Per-rollout cumulative sums are taken in blocks of this many tokens (see segment_cumsum).
CUMSUM_BLOCK = 64


class TokenBaseline(NamedTuple):
    """OTB's result, float64 (N,) each: the baseline B_gt of every token and a_it = G_it - B_gt."""

    baseline: torch.Tensor
    advantage: torch.Tensor


def segment_cumsum(
    values: torch.Tensor, lengths: torch.Tensor, segment_of_value: torch.Tensor | None = None
) -> torch.Tensor:
    """Inclusive cumulative sums of ``values`` (N,) that restart at every segment; the segments
    are consecutive runs of ``lengths`` (S,) values (int64, summing to N). ``segment_of_value``
    (int64 (N,)), when the caller has it, saves recomputing it.

    Restarting matters: the difference of one running sum over the whole batch carries that
    sum's rounding (after a million tokens, a W of 1e-13 would read 0). Each segment is cut
    into blocks of CUMSUM_BLOCK values laid out as the rows of a (blocks, CUMSUM_BLOCK) grid
    (the padding is under one block per segment); a row cumsum sums within blocks, and the
    blocks' totals are summed up within their segment by the same function, one level down.
    """
    n = values.numel()
    if n == 0:
        return values.clone()
    k = CUMSUM_BLOCK
    blocks = (lengths + (k - 1)) // k
    first_block = torch.cumsum(blocks, 0) - blocks
    starts = torch.cumsum(lengths, 0) - lengths
    nonempty = lengths > 0
    if segment_of_value is None:
        segment_of_value = repeat_runs(torch.nonzero(nonempty).flatten(), starts[nonempty], n)
    # grid slot of value j of segment s: first_block[s] * k + j, i.e. flat position + shift[s]
    shift = first_block * k - starts
    slot = shift.index_select(0, segment_of_value)
    slot += torch.arange(n, device=values.device)
    num_blocks = int(blocks.sum())
    grid = values.new_zeros(num_blocks * k).scatter_(0, slot, values).view(num_blocks, k)
    grid = torch.cumsum(grid, 1)
    if num_blocks > int(nonempty.sum()):
        # add to each block the running total of the blocks before it in its segment
        totals = segment_cumsum(grid[:, -1].contiguous(), blocks)
        before = torch.zeros_like(totals)
        before[1:] = totals[:-1]
        before[first_block[nonempty]] = 0.0
        grid += before[:, None]
    return grid.view(-1).gather(0, slot)


def path_variance_proxy(
    logprobs: torch.Tensor, sum_pi_squared: torch.Tensor, is_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """w_it = 1 - 2 exp(logprobs_it) + S_it, times rho_it^2 with importance weights: float64
    (N,). It is >= (1 - pi)^2 >= 0 whenever S holds a distribution's sum of squares."""
    w = torch.exp(logprobs.double())
    w = torch.add(sum_pi_squared.double(), w, alpha=-2.0).add_(1.0)
    if is_weights is not None:
        w *= is_weights.double().square()
    return w


def baseline_cut(batch: RolloutBatch, handle_zero_tail: bool) -> torch.Tensor:
    """int64 (B,): the position from which each rollout's baseline is 0 (its length: none).

    A group of one rollout has no baseline (0). With ``handle_zero_tail``, a group's unique
    longest rollout has none past the second longest's length.
    """
    lengths = batch.lengths
    group = batch.group_index
    alone = batch.group_sizes.index_select(0, group) == 1
    cut = lengths.masked_fill(alone, 0)
    if not handle_zero_tail:
        return cut
    g = batch.num_groups
    longest = lengths.new_zeros(g).scatter_reduce(0, group, lengths, "amax")
    at_longest = lengths == longest.index_select(0, group)
    ties = lengths.new_zeros(g).index_add_(0, group, at_longest.long())
    others = lengths.masked_fill(at_longest, -1)
    second = lengths.new_full((g,), -1).scatter_reduce(0, group, others, "amax")
    unique = at_longest & (ties == 1).index_select(0, group) & ~alone
    return torch.where(unique, second.index_select(0, group), cut)


def optimal_token_baseline(
    batch: RolloutBatch,
    logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    *,
    epsilon: float = 1e-8,
    handle_zero_tail: bool = True,
) -> TokenBaseline:
    """OTB's per-token baseline B and outcome advantage a_it = G_it - B_gt, float64 (N,) each.

    logprobs: the behaviour policy's log-probabilities of the sampled tokens (verl's
    ``old_log_probs``), (N,); sum_pi_squared: S_it = sum_v pi(v | x, y_<t)^2, (N,); is_weights:
    the trainer's truncated importance weights rho_it, (N,), or None.

    G_it = r_i (the outcome reward sits at the last token, so it is every token's reward to go),
    or the batch's ``returns`` when given (rewards spread over tokens: G_it = sum_{j >= t} r_ij);
    B_gt = sum_i G_it W_it / (sum_i W_it + epsilon) over the rollouts i of group g with T_i > t;
    a group of one rollout has B = 0; with ``handle_zero_tail``, a group's unique longest
    rollout has B = 0 past the second longest's length.
    """
    rollout = batch.rollout_of_token
    group, lengths = batch.group_index, batch.lengths
    reward = (
        batch.returns.double()
        if batch.returns is not None
        else batch.rewards.double().index_select(0, rollout)
    )

    w = path_variance_proxy(logprobs, sum_pi_squared, is_weights)
    cumulative = segment_cumsum(w, lengths, rollout)

    # Dense (group, position) keys: group g owns [base_g, base_g + L_g), L_g its longest length.
    # Key of token t of rollout i: base_g + t = flat position + (base_g - offset_i).
    longest = lengths.new_zeros(batch.num_groups).scatter_reduce(0, group, lengths, "amax")
    base = torch.cumsum(longest, 0) - longest
    key = (base.index_select(0, group) - batch.offsets[:-1]).index_select(0, rollout)
    key += torch.arange(batch.num_tokens, device=key.device)
    num_keys = int(longest.sum())
    weighted = cumulative.new_zeros(num_keys).index_add_(0, key, reward * cumulative)
    total = cumulative.new_zeros(num_keys).index_add_(0, key, cumulative)
    per_key = weighted.div_(total.add_(epsilon))

    # No baseline from position cut_i on. Past the cut only rollout i reaches a key (a group of
    # one; or the unique longest, past every other's length), so zero those keys' baselines.
    cut = baseline_cut(batch, handle_zero_tail)
    cut_rows = torch.nonzero(cut < lengths).flatten()
    if cut_rows.numel():
        first_key = (base.index_select(0, group) + cut).index_select(0, cut_rows)
        count = (lengths - cut).index_select(0, cut_rows)
        zero = torch.zeros(num_keys + 1, dtype=torch.int64, device=key.device)
        zero.index_add_(0, first_key, torch.ones_like(first_key))
        zero.index_add_(0, first_key + count, -torch.ones_like(first_key))
        per_key.masked_fill_(torch.cumsum(zero, 0)[:-1] > 0, 0.0)
    baseline = per_key.index_select(0, key)
    return TokenBaseline(baseline=baseline, advantage=reward - baseline)


# ---- the outcome baseline ------------------------------------------------------------------------

PARAMS = (
    Param("epsilon", float, 1e-8, "added to the baseline's denominator sum_i W_it", minimum=0.0),
    Param(
        "handle_zero_tail",
        bool,
        True,
        "no baseline past the second longest rollout for a group's unique longest rollout",
    ),
)


@register_outcome(
    "otb",
    formula="a_it = G_it - B_gt, B_gt = sum_i G_it W_it / (sum_i W_it + eps), "
    "W_it = sum_{j<=t} (1 - 2 pi_ij + S_ij) rho_ij^2, G_it = returns_it (default r_i)",
    paper="Li et al. 2026, arXiv 2602.07078 (optimal token baseline; verl optimal_token_baseline)",
    params=PARAMS,
    per_token=True,
    diagnostics=("otb_baseline",),
    requires=lambda params: {"logprobs": "logprobs", "sum_pi_squared": "sum_pi_squared"},
    optional=("is_weights", "returns"),
)
def otb(batch: RolloutBatch, params: Mapping[str, Any]) -> OutcomeOutput:
    """Optimal token baseline: reward minus a per-(group, position) variance-weighted baseline."""
    assert batch.logprobs is not None and batch.sum_pi_squared is not None  # by `requires`
    result = optimal_token_baseline(
        batch,
        batch.logprobs,
        batch.sum_pi_squared,
        batch.is_weights,
        epsilon=params["epsilon"],
        handle_zero_tail=params["handle_zero_tail"],
    )
    return OutcomeOutput(result.advantage, {"otb_baseline": result.baseline})
