"""GTPO: Group Token Policy Optimization (Tan et al., "GTPO and GRPO-S: Token and Sequence-Level
Reward Shaping with Policy Entropy", arXiv 2508.04349).

Dynamic entropy weighting: the outcome reward of a group's rollouts is redistributed over their
tokens by the policy's entropy H_it, separately for the correct rollouts O+ (reward above
``correct_threshold``) and the wrong ones O-, then normalised into advantages.

At each position t (a token's 0-based index in its rollout), over the rollouts of the class that
reach t (d_t of them in O+, h_t in O-):

    correct (O+):  r~_it = alpha1 r_i + alpha2 d_t H_it / sum_{k in O+, T_k > t} H_kt
    wrong (O-):    r~_it = -alpha1   - alpha2 h_t (1/H_it) / sum_{k in O-, T_k > t} (1/H_kt)

A correct rollout's high-entropy tokens ("forks" that led to the right answer) gain credit; a
wrong rollout's confident (low-entropy) tokens take more of the blame. At every position the
shares sum to 1, so the entropy term hands out exactly alpha2 per rollout and position (with
alpha1 + alpha2 = 1 and 0/1 rewards, the shaped rewards of O+ sum to the outcome rewards: the
paper's reward conservation). Each class is then normalised over the group's tokens, the other
class's tokens counting 0:

    A_it = (r~+_it - mean(R~+)) / (std(R~+) + eps)  for i in O+,  R~+ = {r~+ on O+ tokens, 0 else}
    A_it = (r~-_it - mean(R~-)) / (std(R~-) + eps)  for i in O-,  likewise

(std: the sample standard deviation over the group's tokens). With alpha2 = 0 and 0/1 rewards
this is GRPO's normalisation over tokens, for both classes alike.

Version and sources: arXiv 2508.04349v6 (the ICML 2026 version). No equation number is cited:
the stored text of v6 (and of v5 and v4) that could be read holds the abstract, the
introduction and Figure 1's caption, not the method section. What that text confirms: the
weight ratio H_it / sum_{k=1}^n H_kt "and similar variants" (v6 abstract), GTPO rewarding
high-entropy tokens of correct sequences and suppressing them in incorrect ones, GRPO-S
weighting a sequence by its average token entropy (v6 Figure 1, v4 abstract). What it does not:
the inverse-entropy share of O-, the -1 outcome term of a wrong rollout, the alive counts d_t
and h_t, alpha1 = 1 and alpha2 = 0.1 follow a public re-implementation of the v5 equations, and
the normalisation's reading (each class over all the group's tokens, the other class at 0, so
that alpha2 = 0 gives GRPO) is this service's; none of these was checked against the paper's
equations.
Where the paper leaves a case open:

- a group without both a correct and a wrong rollout (a group of one among them) has no outcome
  contrast and gets A = 0 on every token, as GRPO and DAPO's dynamic sampling leave it;
- at a position where every O+ token has entropy 0, the shares are equal (1/d_t each); where
  some O- tokens have entropy 0 (1/H infinite), those share the position equally and the others
  get 0 (the limit of the ratio); an entropy below 0 (rounding, accepted to -1e-4) counts as 0;
- an empty rollout reaches no position: it takes no share and has no tokens to normalise.

Over the flat batch: (class, group, position) pairs are dense keys (as OTB's (group, position)),
the per-position sums are float32 sums in batch order, the per-rollout sums are segment sums.
On the CPU (:func:`_gtpo_by_slices`) a rollout's keys are one contiguous range, so the sums and
shares are a few numpy calls per rollout on slices, with no per-token keys or gathers; the keyed
path (:func:`_gtpo`, one ``index_add_`` and gathers, nothing looping) gives the same bits and
serves the cases the slices hand back (entropies of 0, float64 classes, other devices).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ..batch import RolloutBatch
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


class Classes(NamedTuple):
    """A batch's rollouts split into O+ and O- per group."""

    correct: torch.Tensor  # bool (B,)
    class_group: torch.Tensor  # int64 (B,): g for a correct rollout, G + g for a wrong one
    contrast: torch.Tensor  # bool (G,): the group has both a correct and a wrong rollout


def split_classes(batch: RolloutBatch, correct_threshold: float) -> Classes:
    """O+ = rollouts with reward > ``correct_threshold``, O- the others, per group."""
    correct = batch.rewards.double() > correct_threshold
    g = batch.num_groups
    class_group = batch.group_index + g * (~correct).long()
    per_class = torch.bincount(class_group, minlength=2 * g)
    contrast = (per_class[:g] > 0) & (per_class[g:] > 0)
    return Classes(correct, class_group, contrast)


def outcome_rewards(batch: RolloutBatch, classes: Classes, alpha1: float) -> torch.Tensor:
    """b_i, the shaped reward's outcome part: alpha1 r_i in O+, -alpha1 in O-; float64 (B,)."""
    r = batch.rewards.double()
    return torch.where(classes.correct, alpha1 * r, torch.full_like(r, -alpha1))


def clamp_entropy(entropy: torch.Tensor) -> torch.Tensor:
    """H as float32, an entropy below 0 (a trainer's rounding) taken as 0 (the input itself when
    it is float32 with none below 0: never written into)."""
    h = entropy.float()
    if h.numel() and float(h.min()) < 0:
        h = h.clamp(min=0.0)
    return h


class GroupNormalisation(NamedTuple):
    """Per class and group (index: the class group, see :class:`Classes`): the mean of R~ over
    the group's tokens or rollouts, and 1 / (std + eps) (0 where the group has no contrast);
    ``flat``: the classes with contrast whose shaped rewards' std is under 1e-3 of their root
    mean square (all alike but for rounding, or nearly: the normalisation divides what is left
    by eps, and float32 rounding must not be what is left)."""

    mean: torch.Tensor  # float64 (2G,)
    scale: torch.Tensor  # float64 (2G,)
    flat: torch.Tensor  # bool (2G,)


def normalise_per_class(
    batch: RolloutBatch,
    classes: Classes,
    sums: torch.Tensor,
    centred_squares: Any,
    weights: torch.Tensor,
    epsilon: float,
) -> GroupNormalisation:
    """mean and 1 / (std + eps) of each class's shaped rewards over its group.

    ``sums``: each rollout's sum of shaped rewards, float64 (B,); ``weights``: what each
    rollout counts for, float64 (B,) (its tokens for GTPO, 1 for GRPO-S); the group's count is
    the sum of its rollouts' weights, the other class's entries counting 0.
    ``centred_squares(mean_of_rollout)``: each rollout's sum of (r~ - mean)^2 over its entries,
    given its class's mean, float64 (B,). The std is the sample std (count - 1).
    """
    g = batch.num_groups
    group = batch.group_index
    cg = classes.class_group
    count = torch.zeros(g, dtype=torch.float64, device=sums.device).index_add_(0, group, weights)
    count2 = torch.cat([count, count])
    class_sum = torch.zeros(2 * g, dtype=torch.float64, device=sums.device)
    class_sum.index_add_(0, cg, sums)
    class_count = torch.zeros(2 * g, dtype=torch.float64, device=sums.device)
    class_count.index_add_(0, cg, weights)
    mean = class_sum / count2.clamp(min=1.0)
    squares = torch.zeros(2 * g, dtype=torch.float64, device=sums.device)
    squares.index_add_(0, cg, centred_squares(mean.index_select(0, cg)))
    size = torch.zeros(2 * g, dtype=torch.float64, device=sums.device)
    size.index_add_(0, cg, centred_squares(torch.zeros_like(sums)))
    # The other class's entries are 0: (0 - mean)^2 each.
    squares += (count2 - class_count) * mean.square()
    squares.clamp_(min=0.0)  # (sums of squares from float32 squares may round below 0)
    std = torch.sqrt(squares / (count2 - 1.0).clamp(min=1.0))
    denominator = std + epsilon
    contrast2 = torch.cat([classes.contrast, classes.contrast])
    usable = contrast2 & (denominator > 0)
    scale = torch.where(usable, 1.0 / torch.where(usable, denominator, 1.0), 0.0)
    rms = torch.sqrt(size / count2.clamp(min=1.0))
    flat = contrast2 & (class_count > 0) & (std <= 1e-3 * rms)
    return GroupNormalisation(mean, scale, flat)


# ---- token-level shaping -------------------------------------------------------------------------


class PositionKeys(NamedTuple):
    """Dense keys of (class group, position): class group c owns [base_c, base_c + L_c), L_c its
    longest rollout; O+ keys come first, so a token is in O- iff its key >= ``first_wrong``."""

    key: torch.Tensor  # int32 (N,)
    of_key: torch.Tensor  # int64 (K,): each key's class group
    alive: torch.Tensor  # float64 (K,): rollouts of the class group that reach the position
    first_wrong: int
    num_keys: int


def position_keys(batch: RolloutBatch, classes: Classes) -> PositionKeys:
    cg = classes.class_group
    lengths = batch.lengths
    num_cg = 2 * batch.num_groups
    longest = lengths.new_zeros(num_cg).scatter_reduce(0, cg, lengths, "amax")
    base = torch.cumsum(longest, 0) - longest
    num_keys = int(longest.sum())
    if num_keys >= 2**31:
        raise ValueError(f"{num_keys} (class, group, position) keys do not fit int32")
    start = base.index_select(0, cg)
    # Token t of rollout i has key start_i + t: a running count that steps by 1 from token to
    # token and jumps at each rollout's first token (one int32 buffer, one cumulative sum).
    nonempty = torch.nonzero(lengths > 0).flatten()
    first = batch.offsets[:-1].index_select(0, nonempty)
    at_first = start.index_select(0, nonempty)
    jump = at_first.clone()
    jump[1:] -= at_first[:-1] + lengths.index_select(0, nonempty)[:-1] - 1
    key = torch.ones(batch.num_tokens, dtype=torch.int32, device=start.device)
    key.scatter_(0, first, jump.to(torch.int32))
    torch.cumsum(key, 0, dtype=torch.int32, out=key)
    # Rollouts alive at each key: +1 where a rollout starts, -1 past its end, summed up.
    edges = torch.zeros(num_keys + 1, dtype=torch.float64, device=key.device)
    edges.index_add_(0, start, torch.ones_like(start, dtype=torch.float64))
    edges.index_add_(0, start + lengths, -torch.ones_like(start, dtype=torch.float64))
    alive = torch.cumsum(edges, 0)[:-1]
    of_key = torch.repeat_interleave(
        torch.arange(num_cg, device=key.device), longest, output_size=num_keys
    )
    first_wrong = int(longest[: batch.num_groups].sum())
    return PositionKeys(key, of_key, alive, first_wrong, num_keys)


def token_shares(entropy: torch.Tensor, keys: PositionKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, S): each token's share of its position is v_it / S[key_it]: v float32 (N,) (a fresh
    tensor, the caller's to reuse), S float32 (K,) > 0 (float32 sums of a group's few values).
    v = H for O+ and 1/H for O-, S their sum over the class's rollouts at the position; where
    those are 0 (every O+ entropy 0) or infinite (some O- entropy 0), the cases the module's
    docstring states. Every key has a rollout that reaches it (a class group's keys span its
    longest rollout)."""
    h = clamp_entropy(entropy)
    key, first_wrong, num_keys = keys.key, keys.first_wrong, keys.num_keys
    v = torch.reciprocal(h)
    torch.where(key >= first_wrong, v, h, out=v)
    total = torch.zeros(num_keys, dtype=torch.float32, device=v.device).index_add_(0, key, v)
    flat = total[:first_wrong] == 0
    if bool(flat.any()):  # every O+ token at the position has H = 0: equal shares
        every = torch.zeros(num_keys, dtype=torch.bool, device=v.device)
        every[:first_wrong] = flat
        v.masked_fill_(every.index_select(0, key), 1.0)
        total = torch.where(every, keys.alive.float(), total)
    if bool(torch.isinf(total[first_wrong:]).any()):  # some O- token has H = 0: they share
        certain = torch.isinf(total)
        zero = torch.isinf(v).float()
        zeros = torch.zeros(num_keys, dtype=torch.float32, device=v.device)
        zeros.index_add_(0, key, zero)
        v = torch.where(certain.index_select(0, key), zero, v)
        total = torch.where(certain, zeros, total)
    return v, total


class TokenShaping(NamedTuple):
    """GTPO's result: ``advantage`` A_it, float32 (N,) (or float64 with rewards that differ
    within a class); ``scalars``: each rollout's mean A_it, float64 (B,); ``reward``: the
    shaped reward r~_it, float64 (N,), when asked for (else None: it costs passes over the
    tokens the advantage does not need)."""

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
) -> TokenShaping:
    """GTPO's shaped token rewards and advantages (the module's formulas).

    entropy: H_it (nats), (N,). The passes over the tokens are float32 and write into two
    buffers (v, then y^2 and each gathered table; y, then A): on a CPU, fresh memory for every
    step costs more than the arithmetic. Sums and group statistics are float64. Where a class
    with contrast has shaped rewards all alike but for float32 rounding (its std is that
    rounding, and the normalisation would divide it by eps: a class whose other class has no
    tokens, with equal entropy shares), that class is computed again in float64, whose
    rounding the division leaves near 0 as the exact answer is; so is a class whose outcome
    terms b_i differ (rewards other than 0/1), whose A takes b_i - b_ref in float64.
    """
    if entropy.device.type == "cpu" and batch.num_tokens:
        fast = _gtpo_by_slices(
            batch, entropy, alpha1, alpha2, correct_threshold, epsilon, with_reward
        )
        if fast is not None:
            return fast
    shaping, wide_classes, keys = _gtpo(
        batch, entropy, torch.float32, alpha1, alpha2, correct_threshold, epsilon, with_reward
    )
    if not bool(wide_classes.any()):
        return shaping
    # Those classes' tokens (and rollouts) take the float64 answer; the others keep theirs, so
    # that a request's answer does not depend on the requests merged with it.
    wide, _, _ = _gtpo(
        batch, entropy, torch.float64, alpha1, alpha2, correct_threshold, epsilon, with_reward
    )
    of_token = wide_classes.index_select(0, keys.of_key).index_select(0, keys.key)
    of_rollout = wide_classes.index_select(0, split_classes(batch, correct_threshold).class_group)
    advantage = torch.where(of_token, wide.advantage, shaping.advantage.double())
    scalars = torch.where(of_rollout, wide.scalars, shaping.scalars)
    reward = None
    if wide.reward is not None and shaping.reward is not None:
        reward = torch.where(of_token, wide.reward, shaping.reward)
    return TokenShaping(advantage, scalars, reward)


def _gtpo_by_slices(
    batch: RolloutBatch,
    entropy: torch.Tensor,
    alpha1: float,
    alpha2: float,
    correct_threshold: float,
    epsilon: float,
    with_reward: bool,
) -> TokenShaping | None:
    """GTPO on the CPU over each rollout's contiguous slice of tokens, the same float32
    arithmetic in the same order as :func:`_gtpo` (the same bits); None where that one must
    decide (an entropy of 0 at some position, a class that comes out flat or whose b_i differ).

    Why: per token, the keyed path builds an int32 key, a class mask, and gathers three per-key
    tables; each is a fresh N-sized buffer whose first touch (page faults) costs more than its
    arithmetic. Here the keys of rollout i's tokens are the range [start_i, start_i + T_i), so
    the per-position sums are slice additions into the (K,) table, in batch order as
    ``index_add_`` adds them, and the tokens need only two buffers: 1/H of the wrong rollouts,
    and the answer. A few numpy calls per rollout cost less than those passes (a batch has
    hundreds of rollouts of thousands of tokens)."""
    classes = split_classes(batch, correct_threshold)
    cg = classes.class_group
    lengths = batch.lengths
    num_cg = 2 * batch.num_groups
    longest = lengths.new_zeros(num_cg).scatter_reduce(0, cg, lengths, "amax")
    base = torch.cumsum(longest, 0) - longest
    num_keys = int(longest.sum())
    first_wrong = int(longest[: batch.num_groups].sum())
    start = base.index_select(0, cg)
    edges = torch.zeros(num_keys + 1, dtype=torch.float64)
    edges.index_add_(0, start, torch.ones_like(start, dtype=torch.float64))
    edges.index_add_(0, start + lengths, -torch.ones_like(start, dtype=torch.float64))
    alive = torch.cumsum(edges, 0)[:-1]
    h = clamp_entropy(entropy).contiguous().numpy()
    # A group without contrast gets A = 0 and scalar 0 whatever its shares: unless the shaped
    # rewards are asked for, its rollouts are only zeroed (GRPO's cost for them).
    busy_class = torch.cat([classes.contrast, classes.contrast]) | with_reward
    busy = busy_class.index_select(0, cg).tolist()
    rollouts: list[tuple[int, int, int, int, bool]] = []
    idle: list[tuple[int, int, int, int, bool]] = []
    for i, (o, t, s, c) in enumerate(
        zip(
            batch.offsets[:-1].tolist(),
            lengths.tolist(),
            start.tolist(),
            classes.correct.tolist(),
            strict=True,
        )
    ):
        if t > 0:
            (rollouts if busy[i] else idle).append((i, o, t, s, not c))
    total = np.zeros(num_keys, dtype=np.float32)
    inverse = np.empty(batch.num_tokens, dtype=np.float32)
    with np.errstate(divide="ignore"):
        for _, o, t, s, wrong in rollouts:
            src = h[o : o + t]
            if wrong:
                src = np.reciprocal(src, out=inverse[o : o + t])
            np.add(total[s : s + t], src, out=total[s : s + t])
    busy_key = np.repeat(busy_class.numpy(), longest.numpy())
    positive = (total[:first_wrong] > 0) | ~busy_key[:first_wrong]
    if not positive.all() or not np.isfinite(total[first_wrong:]).all():
        return None  # entropies of 0: the keyed path's equal shares
    total_t = torch.from_numpy(total)
    factor = alive.to(torch.float32, copy=True).mul_(alpha2).div_(total_t)
    factor[first_wrong:].neg_()
    f = factor.numpy()
    out = np.empty(batch.num_tokens, dtype=np.float32)
    for _, o, t, _, _ in idle:
        out[o : o + t] = 0.0
    for _, o, t, s, wrong in rollouts:
        src = inverse[o : o + t] if wrong else h[o : o + t]
        np.multiply(f[s : s + t], src, out=out[o : o + t])
    y = torch.from_numpy(out)
    b = outcome_rewards(batch, classes, alpha1)
    reward = y.double() + batch.per_token_wide(b) if with_reward else None
    tokens = lengths.double()
    sum_y = batch.rollout_sums(y)
    sum_yy = batch.rollout_sums(torch.from_numpy(np.multiply(out, out, out=inverse)))

    def centred_squares(mean: torch.Tensor) -> torch.Tensor:
        d = b - mean
        return sum_yy + 2.0 * d * sum_y + tokens * d * d

    norm = normalise_per_class(batch, classes, b * tokens + sum_y, centred_squares, tokens, epsilon)
    b_ref = torch.full((num_cg,), -torch.inf, dtype=torch.float64).scatter_reduce(0, cg, b, "amax")
    b_ref = torch.where(torch.isfinite(b_ref), b_ref, torch.zeros_like(b_ref))
    rest = b - b_ref.index_select(0, cg)
    if bool((rest != 0).any()) or bool(norm.flat.any()):
        return None  # float64 for those classes: the keyed path
    shift = (norm.mean - b_ref).to(torch.float32).index_select(0, cg).numpy()
    scale32 = norm.scale.to(torch.float32).index_select(0, cg).numpy()
    for i, o, t, _, _ in rollouts:  # shift[i], scale32[i]: float32 scalars
        part = out[o : o + t]
        np.subtract(part, shift[i], out=part)
        np.multiply(part, scale32[i], out=part)
    scale = norm.scale.index_select(0, cg)
    c = (b - norm.mean.index_select(0, cg)) * scale
    scalars = torch.where(
        tokens > 0, c + scale * sum_y / tokens.clamp(min=1.0), torch.zeros_like(c)
    )
    return TokenShaping(y, scalars, reward)


def _gtpo(
    batch: RolloutBatch,
    entropy: torch.Tensor,
    dtype: torch.dtype,
    alpha1: float,
    alpha2: float,
    correct_threshold: float,
    epsilon: float,
    with_reward: bool,
) -> tuple[TokenShaping, torch.Tensor, PositionKeys]:
    """GTPO in ``dtype`` per token; the classes a float32 pass leaves to a float64 one (bool
    (2G,): those that came out flat, and those whose outcome terms b_i differ, which float32
    does not compute); the keys."""
    classes = split_classes(batch, correct_threshold)
    keys = position_keys(batch, classes)
    key = keys.key
    v, total = token_shares(entropy, keys)
    v = v.to(dtype)
    # y_it = +-alpha2 d_t v_it / S_t: the entropy part of r~ (O- negative).
    factor = keys.alive.to(dtype, copy=True).mul_(alpha2).div_(total.to(dtype))
    factor[keys.first_wrong :].neg_()
    y = factor.index_select(0, key).mul_(v)
    b = outcome_rewards(batch, classes, alpha1)
    reward = y.double() + batch.per_token_wide(b) if with_reward else None
    tokens = batch.lengths.double()
    sum_y = batch.rollout_sums(y)
    spare = torch.mul(y, y, out=v)  # v is not needed past y
    sum_yy = batch.rollout_sums(spare)

    def centred_squares(mean: torch.Tensor) -> torch.Tensor:
        # sum_t (b_i + y_it - m)^2, from the sums of y and y^2
        d = b - mean
        return sum_yy + 2.0 * d * sum_y + tokens * d * d

    norm = normalise_per_class(batch, classes, b * tokens + sum_y, centred_squares, tokens, epsilon)
    cg = classes.class_group
    scale = norm.scale.index_select(0, cg)
    # A_it = (y_it - (m - b_i)) scale: m - b_ref per key, b_ref the class's b (one value with
    # 0/1 rewards); a class whose b_i differ adds b_i - b_ref first, in float64.
    b_ref = torch.full((2 * batch.num_groups,), -torch.inf, dtype=torch.float64, device=b.device)
    b_ref = b_ref.scatter_reduce(0, cg, b, "amax")
    b_ref = torch.where(torch.isfinite(b_ref), b_ref, torch.zeros_like(b_ref))
    rest = b - b_ref.index_select(0, cg)
    varying = torch.zeros(2 * batch.num_groups, dtype=torch.bool, device=b.device)
    varying.index_put_((cg,), rest != 0, accumulate=True)
    advantage = y
    if dtype == torch.float64 and bool(varying.any()):
        advantage = y.add_(batch.per_token_wide(rest))
    shift = (norm.mean - b_ref).to(dtype).index_select(0, keys.of_key)
    advantage.sub_(torch.index_select(shift, 0, key, out=spare))
    scale_of_key = norm.scale.to(dtype).index_select(0, keys.of_key)
    advantage.mul_(torch.index_select(scale_of_key, 0, key, out=spare))
    c = (b - norm.mean.index_select(0, cg)) * scale
    scalars = torch.where(
        tokens > 0, c + scale * sum_y / tokens.clamp(min=1.0), torch.zeros_like(c)
    )
    return TokenShaping(advantage, scalars, reward), norm.flat | varying, keys


@register_outcome(
    "gtpo",
    formula="r~_it = alpha1 r_i + alpha2 d_t H_it / sum_O+ H_kt (correct), -alpha1 - alpha2 h_t "
    "H_it^-1 / sum_O- H_kt^-1 (wrong); A_it = (r~_it - mean) / (std + eps) per class over the "
    "group's tokens",
    paper="Tan et al. 2025, GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with "
    "Policy Entropy, arXiv 2508.04349v6 (GTPO)",
    params=PARAMS,
    per_token=True,
    diagnostics=("gtpo_reward",),
    requires=lambda params: {"entropy": "entropy"},
)
def gtpo(batch: RolloutBatch, params: Mapping[str, Any]) -> OutcomeOutput:
    """Entropy-shaped token rewards of the correct and wrong rollouts, normalised per class."""
    assert batch.entropy is not None  # by `requires`
    entropy = batch.entropy
    options = {k: params[k] for k in ("alpha1", "alpha2", "correct_threshold", "epsilon")}
    shaping = gtpo_advantage(batch, entropy, **options)

    def reward() -> torch.Tensor:
        shaped = gtpo_advantage(batch, entropy, with_reward=True, **options).reward
        assert shaped is not None
        return shaped

    return OutcomeOutput(
        shaping.advantage, diagnostics={"gtpo_reward": reward}, scalars=shaping.scalars
    )
