"""GTPO: Group Token Policy Optimization (Tan et al., "GTPO and GRPO-S: Token and Sequence-Level
Reward Shaping with Policy Entropy", arXiv 2508.04349).

Dynamic entropy weighting: the outcome reward of a group's rollouts is redistributed over their
tokens by the policy's entropy H_it, separately for the correct rollouts O+ (reward above
``correct_threshold``) and the wrong ones O-, then normalised into advantages.

At each position t (a token's 0-based index in its rollout), over the rollouts of the class that
reach t (d_t of them in O+, h_t in O-):

    correct (O+), Eq. 3:  r~+_it = alpha1 r_i + alpha2 d_t H_it / sum_{k in O+, T_k > t} H_kt
    wrong (O-),   Eq. 5:  r~-_it = -alpha1   - alpha2 h_t (1/H_it) / sum_{k in O-, T_k > t} (1/H_kt)

A correct rollout's high-entropy tokens ("forks" that led to the right answer) gain credit; a
wrong rollout's confident (low-entropy) tokens take more of the blame. At every position the
shares sum to 1, so the entropy term hands out exactly alpha2 per rollout and position (with
alpha1 + alpha2 = 1 and 0/1 rewards, the shaped rewards of O+ at a position sum to d_t: the
paper's reward conservation, Proposition 2.2). Each class is then normalised over its own
tokens, Eq. 6:

    A+_it = (r~+_it - mean(R~+)) / (std(R~+) + eps),  R~+ = {r~+_it : i in O+, t < T_i}
    A-_it = (r~-_it - mean(R~-)) / (std(R~-) + eps),  likewise

(std: the sample standard deviation). The outcome term is one value per class with 0/1 rewards,
so it cancels: what the advantage carries is the entropy contrast within each class (a correct
rollout's tokens above its class's mean share gain, those below lose; in a wrong rollout the
confident tokens lose most); the paper's objective (Eq. 7) sums the clipped surrogates of both
classes over all tokens. With rewards other than 0/1, alpha1 r_i also differs within O+.

Version and sources: arXiv 2508.04349v6 (the ICML 2026 version); its method section could not
be read from here (the stored text of v6, v5 and v4 holds the abstract, the introduction and
Figure 1's caption), so the equations follow the v5 equations as public re-implementations
quote them with their numbers (Eq. 3 and 5 the shaped rewards, Eq. 6 the normalisation, Eq. 7
the objective, Remark 2.1 the eps in entropy denominators, Proposition 2.2 the conservation),
and reviewers of the v5 submission confirm the inverse-entropy normalisation of O-. What the
stored v6 text confirms: the weight ratio H_it / sum_{k=1}^n H_kt "and similar variants" (the
abstract), GTPO rewarding high-entropy tokens of correct sequences and suppressing them in
incorrect ones (Figure 1). The defaults alpha1 = 1, alpha2 = 0.1 are the paper's experiments'
as those re-implementations give them. Where this service chooses:

- the scope of Eq. 6 is the group: the re-implementations normalise over the training batch,
  which would make a group's answer depend on the other prompts it is sent with (and on how
  requests are merged); each group here is normalised on its own, as GRPO's groups are;
- eps is added to the sample std (the re-implementations differ: inside a square root, or a
  clamp), and the entropy shares divide exactly (the cases below, not H + eps);
- a group without both a correct and a wrong rollout (a group of one among them) gets A = 0 on
  every token, as GRPO and DAPO's dynamic sampling (the paper's baseline) leave it; a class of
  one rollout (share 1 at every position: all its shaped rewards alike) gets A = 0;
- at a position where every O+ token has entropy 0, the shares are equal (1/d_t each); where
  some O- tokens have entropy 0 (1/H infinite), those share the position equally and the others
  get 0 (the limit of the ratio); an entropy below 0 (rounding, accepted to -1e-4) counts as 0;
- an empty rollout reaches no position: it takes no share and has no tokens to normalise.

Over the flat batch: (class, group, position) pairs are dense keys (as OTB's (group, position));
the per-position sums S (of v = H in O+, 1/H in O-) and Q (of v^2) are float64 sums in batch
order, and from them alone each class's mean and std (its sum of y = r~ - b is +-alpha2 times
its tokens; its sum of y^2 is sum_k F_k^2 Q_k): no pass over the tokens for the statistics. On
the CPU (:func:`_gtpo_compiled`) a rollout's keys are one contiguous range, so the sums and the
answer are two compiled loops over each rollout's slice (:mod:`.gtpo_kernels`; with Eq. 6 over
the group, one group at a time), with no per-token keys or gathers; the keyed path
(:func:`_gtpo`, ``index_add_`` and gathers, nothing looping) gives the same bits and serves the
cases the loops hand back (entropies of 0, classes computed again in float64, other devices).

The parts: :mod:`.gtpo_shaping` (the classes O+ and O-, the keys, the entropy shares and the
per-key factor), :mod:`.gtpo_statistics` (each class's mean and std, Eq. 6, as a scale and a
shift); this module, the method: its parameters, the keyed path and the compiled loops that put
them together, and its registration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ..batch import RolloutBatch
from .gtpo_shaping import (
    Classes,
    KeyLayout,
    clamp_entropy,
    key_factor,
    key_layout,
    outcome_rewards,
    split_classes,
    token_keys,
    token_shares,
)
from .gtpo_statistics import (
    SCOPES,
    WIDE_BELOW,
    Normalisation,
    Pools,
    class_statistics_numpy,
    normalise,
    request_pools,
)
from .registry import OutcomeOutput, Param, register_outcome

PARAMS = (
    Param(
        "alpha1",
        float,
        1.0,
        "alpha_1: the weight of the outcome reward (r_i for a correct rollout, -1 for a wrong "
        "one) in the shaped reward",
        minimum=0.0,
    ),
    Param(
        "alpha2",
        float,
        0.1,
        "alpha_2: the weight of the entropy-weighted share in the shaped reward",
        minimum=0.0,
    ),
    Param(
        "correct_threshold",
        float,
        0.0,
        "a rollout is correct (O+) when its reward is above this, wrong (O-) otherwise",
    ),
    Param(
        "epsilon",
        float,
        1e-6,
        "added to the standard deviation of the shaped rewards",
        minimum=0.0,
    ),
)
# GTPO's own: where Eq. 6 normalises (GRPO-S shares the parameters above).
GTPO_PARAMS = (
    *PARAMS,
    Param(
        "scope",
        str,
        "group",
        "Eq. 6's mean and std of a class: over its own tokens in the group (the paper's "
        "equation), or over its tokens in the request, of every group with contrast (the "
        "authors' runs: 'our current implementation operates at the batch level'); a request "
        "merged with others is normalised on its own",
        choices=SCOPES,
    ),
)


class TokenShaping(NamedTuple):
    """GTPO's result: ``advantage`` A_it, float32 (N,) (or float64 where a class needs it);
    ``scalars``: each rollout's mean A_it, float64 (B,); ``reward``: the shaped reward r~_it,
    float64 (N,), when asked for (else None: it costs passes over the tokens the advantage does
    not need)."""

    advantage: torch.Tensor
    scalars: torch.Tensor
    reward: torch.Tensor | None


def gtpo_advantage(
    batch: RolloutBatch,
    entropy: torch.Tensor,
    *,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    correct_threshold: float = 0.0,
    epsilon: float = 1e-6,
    with_reward: bool = False,
    scope: str = "group",
) -> TokenShaping:
    """GTPO's shaped token rewards and advantages (the module's formulas).

    entropy: H_it (nats), (N,). The token passes are float32 (v = H or 1/H, A = P_k v + shift);
    the per-position sums S and Q and factors F, the sums over classes, the class statistics
    and P_k = F_k scale, float64 (a float32 F, alike over a long run of positions, biased a
    class's sum of squares by more than its tiny spread). A class whose answer float32 cannot
    give (nearly flat shaped rewards: ``gtpo_statistics.WIDE_BELOW``; outcome terms b_i that
    differ: rewards other than 0/1) is computed again in
    float64, and only its tokens take that answer, so that a request's answer does not depend on
    the requests merged with it.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    request = scope == "request"
    if entropy.device.type == "cpu" and batch.num_tokens and not with_reward:
        fast = _gtpo_compiled(batch, entropy, alpha1, alpha2, correct_threshold, epsilon, request)
        if fast is not None:
            return fast
    options = (alpha1, alpha2, correct_threshold, epsilon, with_reward, request)
    shaping, wide_classes, of_token = _gtpo(batch, entropy, torch.float32, *options)
    if not bool(wide_classes.any()):
        return shaping
    wide, _, _ = _gtpo(batch, entropy, torch.float64, *options)
    on_token = wide_classes.index_select(0, of_token)
    on_rollout = wide_classes.index_select(0, split_classes(batch, correct_threshold).class_group)
    advantage = torch.where(on_token, wide.advantage, shaping.advantage.double())
    scalars = torch.where(on_rollout, wide.scalars, shaping.scalars)
    reward = None
    if wide.reward is not None and shaping.reward is not None:
        reward = torch.where(on_token, wide.reward, shaping.reward)
    return TokenShaping(advantage, scalars, reward)


def _scalars(batch: RolloutBatch, advantage: torch.Tensor) -> torch.Tensor:
    """Each rollout's mean advantage, float64 (B,), 0 for an empty rollout. On the CPU each
    rollout's float64 sum is the compiled loop's (the bits :func:`_gtpo_compiled` gives)."""
    lengths = batch.lengths.double().clamp(min=1.0)
    if advantage.device.type != "cpu":
        return batch.rollout_sums(advantage) / lengths
    from . import kernels  # (numba is imported when a compiled loop first runs)

    offsets = batch.offsets.numpy()
    return torch.from_numpy(kernels.segment_sums(advantage.contiguous().numpy(), offsets)) / lengths


def _gtpo_compiled(
    batch: RolloutBatch,
    entropy: torch.Tensor,
    alpha1: float,
    alpha2: float,
    correct_threshold: float,
    epsilon: float,
    request: bool = False,
) -> TokenShaping | None:
    """GTPO on the CPU by compiled loops over each rollout's contiguous slice of tokens
    (:mod:`.gtpo_kernels`): the same float32 arithmetic in the same order as :func:`_gtpo` (the
    same bits); None where that one must decide (an entropy of 0 at some position, a class its
    float32 pass leaves to float64).

    Why: per token, the keyed path builds an int32 key, gathers per-key tables and scatters
    into them; each is a pass over N tokens with a fresh N-sized buffer. Here the keys of
    rollout i's tokens are the range [start_i, start_i + T_i): one loop adds v and v^2 into
    the per-position tables S and Q (and counts the rollouts reaching each position), the
    other writes A = F scale v + shift and takes each rollout's sum while its slice is in
    cache. With Eq. 6 over the group (the default) both run one group at a time, so a group's
    entropies are read from memory once and its tables stay in cache; over the request, the
    statistics pool the groups, so each loop runs over the whole batch. A group without
    contrast takes no part in the sums and gets 0."""
    from . import gtpo_kernels  # (numba is imported when a compiled loop first runs)

    g = batch.num_groups
    offsets = batch.offsets.numpy()
    rewards = batch.rewards.numpy().astype(np.float64)
    correct = rewards > correct_threshold
    wrong = ~correct
    b = np.where(correct, alpha1 * rewards, -alpha1)
    h = entropy.float().contiguous().numpy()
    out = np.empty(batch.num_tokens, dtype=np.float32)
    if request:
        sums = _gtpo_over_the_batch(batch, h, wrong, b, alpha2, epsilon, out)
        if sums is None:
            return None
    else:
        group_index = batch.group_index.numpy()
        status, sums = gtpo_kernels.gtpo_grouped(
            h, offsets, group_index, g, wrong, b, alpha2, epsilon, WIDE_BELOW, out
        )
        if status:
            return None
    scalars = sums / np.maximum(np.diff(offsets).astype(np.float64), 1.0)
    return TokenShaping(torch.from_numpy(out), torch.from_numpy(scalars), None)


def _gtpo_over_the_batch(
    batch: RolloutBatch,
    h: np.ndarray,
    wrong: np.ndarray,
    b: np.ndarray,
    alpha2: float,
    epsilon: float,
    out: np.ndarray,
) -> np.ndarray | None:
    """Scope ``request``: the compiled loops over the whole batch's (class, group, position)
    tables, the statistics pooled per request; A into ``out``, each rollout's float64 sum of
    it (None where the keyed path must decide). What split_classes and key_layout compute, in
    numpy (per rollout and per class group: a numpy call costs a microsecond, a torch one
    several)."""
    from . import gtpo_kernels, kernels

    g = batch.num_groups
    offsets = batch.offsets.numpy()
    lengths = np.diff(offsets)
    cg = batch.group_index.numpy() + g * wrong
    per_class = np.bincount(cg, minlength=2 * g)
    contrast = (per_class[:g] > 0) & (per_class[g:] > 0)
    busy = np.concatenate([contrast, contrast])[cg]
    longest = np.zeros(2 * g, np.int64)
    np.maximum.at(longest, cg, lengths)
    num_keys = int(longest.sum())
    if num_keys >= 2**31:
        raise ValueError(f"{num_keys} (class, group, position) keys do not fit int32")
    start = (np.cumsum(longest) - longest)[cg]
    first_wrong = int(longest[:g].sum())
    total, squares, factor = kernels.scratch_tables(num_keys, 3, np.float64)
    alive, per_key = kernels.scratch_tables(num_keys, 2)
    negative = gtpo_kernels.gtpo_position_sums(
        h, offsets, start, busy, wrong, total, squares, alive
    )
    if gtpo_kernels.gtpo_factor(total, alive, first_wrong, alpha2, factor):
        return None  # an entropy of 0 where the keyed path's shares decide
    y2 = gtpo_kernels.class_square_sums(factor, squares, longest)
    pools = request_pools(batch, contrast)
    scale, shift, wide = class_statistics_numpy(
        lengths, cg, contrast, y2, b, alpha2, epsilon, None, pools
    )
    if wide.any():
        return None
    gtpo_kernels.gtpo_per_key(factor, scale, longest, per_key)
    return gtpo_kernels.gtpo_write(
        h, offsets, start, busy, wrong, negative, per_key, scale[cg], shift.astype(np.float32), out
    )


def _gtpo(
    batch: RolloutBatch,
    entropy: torch.Tensor,
    dtype: torch.dtype,
    alpha1: float,
    alpha2: float,
    correct_threshold: float,
    epsilon: float,
    with_reward: bool,
    request: bool = False,
) -> tuple[TokenShaping, torch.Tensor, torch.Tensor]:
    """GTPO in ``dtype`` per token, by per-token keys (any device); the classes a float32 pass
    leaves to a float64 one (bool (2G,)); each token's class group (int64 (N,))."""
    classes = split_classes(batch, correct_threshold)
    layout = key_layout(batch, classes)
    alive = layout.alive(batch.lengths)
    key = token_keys(batch, layout)
    v, total = token_shares(entropy, layout, alive, key, dtype)
    squares = torch.zeros_like(total).index_add_(0, key, v.double().square())
    factor = key_factor(alive, total, layout.first_wrong, alpha2)
    b = outcome_rewards(batch, classes, alpha1)
    y = None
    if with_reward or dtype == torch.float64:
        y = factor.index_select(0, key).mul_(v)
    rollout_y = batch.rollout_sums(y) if dtype == torch.float64 and y is not None else None
    y2 = layout.square_sums(factor, squares)
    pools: Pools | None = None
    if request:
        pools = request_pools(batch, classes.contrast.cpu().numpy())
    norm = normalise(batch, classes, y2, b, alpha2, epsilon, rollout_y, pools)
    scale_of_key = layout.per_key(norm.scale)
    per_key = factor.mul(scale_of_key)
    # (a factor may be infinite where its class is left out: a group without contrast)
    per_key.masked_fill_(scale_of_key == 0, 0.0)
    advantage = per_key.to(dtype).index_select(0, key).mul_(v)
    advantage += batch.per_token(norm.shift.to(dtype))  # (the compiled loop's float32 addition)
    reward = y.double() + batch.per_token_wide(b) if with_reward and y is not None else None
    of_token = layout.of_key().index_select(0, key)
    return TokenShaping(advantage, _scalars(batch, advantage), reward), norm.wide, of_token


@register_outcome(
    "gtpo",
    formula="r~_it = alpha1 r_i + alpha2 d_t H_it / sum_O+ H_kt (correct), -alpha1 - alpha2 h_t "
    "H_it^-1 / sum_O- H_kt^-1 (wrong); A_it = (r~_it - mean) / (std + eps) per class over its "
    "own tokens in the group",
    paper="Tan et al. 2025, GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with "
    "Policy Entropy, arXiv 2508.04349v6 (GTPO)",
    params=GTPO_PARAMS,
    per_token=True,
    diagnostics=("gtpo_reward",),
    requires=lambda params: {"entropy": "entropy"},
)
def gtpo(batch: RolloutBatch, params: Mapping[str, Any]) -> OutcomeOutput:
    """Entropy-shaped token rewards of the correct and wrong rollouts, normalised per class."""
    assert batch.entropy is not None  # by `requires`
    entropy = batch.entropy
    names = ("alpha1", "alpha2", "correct_threshold", "epsilon", "scope")
    options = {k: params[k] for k in names}
    shaping = gtpo_advantage(batch, entropy, **options)

    def reward() -> torch.Tensor:
        shaped = gtpo_advantage(batch, entropy, with_reward=True, **options).reward
        assert shaped is not None
        return shaped

    return OutcomeOutput(
        shaping.advantage, diagnostics={"gtpo_reward": reward}, scalars=shaping.scalars
    )


__all__ = [
    "GTPO_PARAMS",
    "PARAMS",
    "Classes",
    "KeyLayout",
    "Normalisation",
    "TokenShaping",
    "clamp_entropy",
    "gtpo",
    "gtpo_advantage",
    "key_factor",
    "key_layout",
    "normalise",
    "outcome_rewards",
    "split_classes",
    "token_keys",
    "token_shares",
]
