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
the per-position sums S (of v = H in O+, 1/H in O-) and Q (of v^2) are float32 sums in batch
order, and from them alone each class's mean and std (its sum of y = r~ - b is +-alpha2 times
its tokens; its sum of y^2 is sum_k F_k^2 Q_k): no pass over the tokens for the statistics. On
the CPU (:func:`_gtpo_compiled`) a rollout's keys are one contiguous range, so the sums and the
answer are two compiled loops over each rollout's slice (:mod:`.kernels`), with no per-token
keys or gathers; the keyed path (:func:`_gtpo`, ``index_add_`` and gathers, nothing looping)
gives the same bits and serves the cases the loops hand back (entropies of 0, classes computed
again in float64, other devices).
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


# ---- token-level shaping -------------------------------------------------------------------------


class KeyLayout(NamedTuple):
    """Dense keys of (class group, position): class group c owns ``longest[c]`` consecutive
    keys, one per position of its longest rollout, class groups in order; O+ keys come first,
    so a token is in O- iff its key >= ``first_wrong``."""

    start: torch.Tensor  # int64 (B,): the key of each rollout's first token
    longest: torch.Tensor  # int64 (2G,): each class group's longest rollout
    first_wrong: int
    num_keys: int

    def of_key(self) -> torch.Tensor:
        """int64 (K,): each key's class group."""
        groups = torch.arange(self.longest.numel(), device=self.longest.device)
        return torch.repeat_interleave(groups, self.longest, output_size=self.num_keys)

    def alive(self, lengths: torch.Tensor) -> torch.Tensor:
        """float64 (K,): the class group's rollouts that reach each key (``lengths``: T_i,
        (B,)): +1 where a rollout starts, -1 past its end, summed up."""
        edges = torch.zeros(self.num_keys + 1, dtype=torch.float64, device=self.start.device)
        edges.index_add_(0, self.start, torch.ones_like(self.start, dtype=torch.float64))
        edges.index_add_(0, self.start + lengths, -torch.ones_like(self.start, dtype=torch.float64))
        return torch.cumsum(edges, 0)[:-1]

    def square_sums(self, factor: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """Per class group, sum_k F_k^2 Q_k over its keys in float64: float64 (2G,) (on the CPU
        the compiled loop's order, which the fast path shares)."""
        if factor.device.type == "cpu":
            from . import kernels  # (numba is imported when a compiled loop first runs)

            return torch.from_numpy(
                kernels.class_square_sums(
                    factor.contiguous().numpy(), squares.contiguous().numpy(), self.longest.numpy()
                )
            )
        f2q = factor.to(torch.float64, copy=True)
        f2q.square_().mul_(squares)
        out = torch.zeros(self.longest.numel(), dtype=torch.float64, device=factor.device)
        return out.index_add_(0, self.of_key(), f2q)

    def per_key(self, values: torch.Tensor) -> torch.Tensor:
        """Per-class-group ``values`` (2G,) repeated over each class group's keys: (K,)."""
        if values.device.type == "cpu":
            return torch.from_numpy(np.repeat(values.numpy(), self.longest.numpy()))
        return torch.repeat_interleave(values, self.longest, output_size=self.num_keys)


def key_layout(batch: RolloutBatch, classes: Classes) -> KeyLayout:
    cg = classes.class_group
    lengths = batch.lengths
    num_cg = 2 * batch.num_groups
    longest = lengths.new_zeros(num_cg).scatter_reduce(0, cg, lengths, "amax")
    base = torch.cumsum(longest, 0) - longest
    num_keys = int(longest.sum())
    if num_keys >= 2**31:
        raise ValueError(f"{num_keys} (class, group, position) keys do not fit int32")
    start = base.index_select(0, cg)
    first_wrong = int(longest[: batch.num_groups].sum())
    return KeyLayout(start, longest, first_wrong, num_keys)


def token_keys(batch: RolloutBatch, layout: KeyLayout) -> torch.Tensor:
    """int32 (N,): token t of rollout i has key start_i + t."""
    lengths = batch.lengths
    # A running count that steps by 1 from token to token and jumps at each rollout's first
    # token (one int32 buffer, one cumulative sum).
    nonempty = torch.nonzero(lengths > 0).flatten()
    first = batch.offsets[:-1].index_select(0, nonempty)
    at_first = layout.start.index_select(0, nonempty)
    jump = at_first.clone()
    jump[1:] -= at_first[:-1] + lengths.index_select(0, nonempty)[:-1] - 1
    key = torch.ones(batch.num_tokens, dtype=torch.int32, device=jump.device)
    key.scatter_(0, first, jump.to(torch.int32))
    torch.cumsum(key, 0, dtype=torch.int32, out=key)
    return key


def token_shares(
    entropy: torch.Tensor,
    layout: KeyLayout,
    alive: torch.Tensor,
    key: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, S): token i's share of its position is v_it / S[key_it]: v ``dtype`` (N,) (a fresh
    tensor, the caller's to reuse), S ``dtype`` (K,) (sums in batch order). v = H for O+ and 1/H
    for O-, S their sum over the class's rollouts at the position; where those are 0 (every O+
    entropy 0) or infinite (some O- entropy 0), the cases the module's docstring states. Every
    key has a rollout that reaches it (a class group's keys span its longest rollout)."""
    h = clamp_entropy(entropy).to(dtype)
    first_wrong, num_keys = layout.first_wrong, layout.num_keys
    v = torch.reciprocal(h)
    torch.where(key >= first_wrong, v, h, out=v)
    total = torch.zeros(num_keys, dtype=dtype, device=v.device).index_add_(0, key, v)
    flat = total[:first_wrong] == 0
    if bool(flat.any()):  # every O+ token at the position has H = 0: equal shares
        every = torch.zeros(num_keys, dtype=torch.bool, device=v.device)
        every[:first_wrong] = flat
        v.masked_fill_(every.index_select(0, key), 1.0)
        total = torch.where(every, alive.to(dtype), total)
    if bool(torch.isinf(total[first_wrong:]).any()):  # some O- token has H = 0: they share
        certain = torch.isinf(total)
        zero = torch.isinf(v).to(dtype)
        zeros = torch.zeros(num_keys, dtype=dtype, device=v.device)
        zeros.index_add_(0, key, zero)
        v = torch.where(certain.index_select(0, key), zero, v)
        total = torch.where(certain, zeros, total)
    return v, total


def key_factor(
    alive: torch.Tensor, total: torch.Tensor, first_wrong: int, alpha2: float
) -> torch.Tensor:
    """y_it = F[key_it] v_it, the entropy part of r~ (O- negative): F = +-alpha2 d_t / S_t, in
    ``total``'s dtype (K,) (d_t: ``alive``)."""
    factor = alive.to(total.dtype, copy=True).mul_(alpha2).div_(total)
    factor[first_wrong:].neg_()
    return factor


class Normalisation(NamedTuple):
    """A_it = F[key_it] ``scale``_c v_it + ``shift``_i: ``scale`` 1 / (std + eps) of each class
    group, float64 (2G,) (0 for a class without contrast or of one rollout); ``shift`` (b_i -
    mean) / (std + eps), float64 (B,); ``wide``, bool (2G,): the classes whose answer a float32
    pass leaves to a float64 one."""

    scale: torch.Tensor
    shift: torch.Tensor
    wide: torch.Tensor


def normalise(
    batch: RolloutBatch,
    classes: Classes,
    y2: torch.Tensor,
    b: torch.Tensor,
    alpha2: float,
    epsilon: float,
    rollout_y: torch.Tensor | None = None,
) -> Normalisation:
    """Each class's mean and sample std of r~_it = b_i + y_it over its own tokens in the group
    (Eq. 6), from per-key sums: y sums to +-alpha2 d_t at each key (the shares sum to 1), so a
    class's sum of y is +-alpha2 n_c (n_c its tokens); its sum of y^2 is ``y2`` = sum_k F_k^2
    Q_k, with Q_k the sum of v^2 at key k (:meth:`KeyLayout.square_sums`). Where the b_i of a
    class differ (rewards other than 0/1), the cross terms need each rollout's sum of y
    (``rollout_y``, float64 (B,)); without it those classes are ``wide``.

    A class of one rollout has r~ = b + alpha2 on every token (its share is 1 at each position):
    its std is 0 and so is its advantage, set here exactly (float32 rounding of y would
    otherwise be divided by eps). A class whose std is under 1e-3 of its entropy part's root
    mean square in a float32 pass (shares all alike but for rounding, which the division by
    std + eps would amplify) is ``wide``, as are classes whose Q overflowed float32.

    Every array here has a value per rollout or per class group: on the CPU numpy's (a call
    costs a microsecond; torch's several), elsewhere torch's."""
    if b.device.type == "cpu":
        scale, shift, wide = _class_statistics_numpy(
            batch.lengths.numpy(),
            classes.class_group.numpy(),
            classes.contrast.numpy(),
            y2.numpy(),
            b.numpy(),
            alpha2,
            epsilon,
            None if rollout_y is None else rollout_y.numpy(),
        )
        return Normalisation(
            torch.from_numpy(scale), torch.from_numpy(shift), torch.from_numpy(wide)
        )
    return Normalisation(
        *_class_statistics(
            _TorchOps(b.device),
            batch.lengths.double(),
            (batch.lengths > 0).double(),
            classes.class_group,
            classes.contrast,
            y2,
            b,
            alpha2,
            epsilon,
            rollout_y,
        )
    )


def _class_statistics_numpy(
    lengths: np.ndarray,
    cg: np.ndarray,
    group_contrast: np.ndarray,
    y2: np.ndarray,
    b: np.ndarray,
    alpha2: float,
    epsilon: float,
    rollout_y: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_class_statistics` in numpy from the rollouts' lengths (T_i, int (B,))."""
    with np.errstate(all="ignore"):  # (classes left out may hold inf or nan: unused)
        return _class_statistics(
            np,
            lengths.astype(np.float64),
            (lengths > 0).astype(np.float64),
            cg,
            group_contrast,
            y2,
            b,
            alpha2,
            epsilon,
            rollout_y,
        )


class _TorchOps:
    """The few numpy functions :func:`_class_statistics` calls, on torch tensors of a device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sqrt = torch.sqrt
        self.isfinite = torch.isfinite
        self.where = torch.where
        self.concatenate = torch.cat
        self.float64 = torch.float64

    def zeros(self, n: int, dtype: Any) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def full(self, n: int, value: float, dtype: Any) -> torch.Tensor:
        return torch.full((n,), value, dtype=dtype, device=self.device)

    @staticmethod
    def add_at(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
        out.index_add_(0, index, values)

    @staticmethod
    def max_at(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
        out.scatter_reduce_(0, index, values, "amax")

    @staticmethod
    def maximum(x: torch.Tensor, floor: float) -> torch.Tensor:
        return x.clamp(min=floor)


class _NumpyOps:
    """numpy's, with the two scatters named as :class:`_TorchOps` names them."""

    add_at = staticmethod(np.add.at)
    max_at = staticmethod(np.maximum.at)
    maximum = staticmethod(np.maximum)


def _class_statistics(
    xp: Any,
    tokens: Any,
    has_tokens: Any,
    cg: Any,
    group_contrast: Any,
    y2: Any,
    b: Any,
    alpha2: float,
    epsilon: float,
    rollout_y: Any,
) -> tuple[Any, Any, Any]:
    """:func:`normalise`'s arithmetic on per-rollout and per-class-group arrays of ``xp``
    (numpy, or :class:`_TorchOps`): (scale, shift, wide). The same float64 operations in the
    same order either way (sums over a class's rollouts in batch order)."""
    ops = _NumpyOps if xp is np else xp
    num_cg = y2.shape[0]
    g = num_cg // 2

    def per_class(values: Any) -> Any:
        out = xp.zeros(num_cg, xp.float64)
        ops.add_at(out, cg, values)
        return out

    n = per_class(tokens)
    members = per_class(has_tokens)
    sign = xp.full(num_cg, 1.0, xp.float64)
    sign[g:] = -1.0
    sum_y = sign * alpha2 * n
    # Centred on b_ref, one b_i of the class: with 0/1 rewards every b_i - b_ref is 0 exactly,
    # and so is the mean's outcome part (a mean of equal values in floating point may not be).
    b_ref = xp.full(num_cg, -np.inf, xp.float64)
    ops.max_at(b_ref, cg, b)
    rel = b - b_ref[cg]
    varying = per_class(abs(rel)) > 0
    n1 = ops.maximum(n, 1.0)
    mean = (per_class(rel * tokens) + sum_y) / n1
    d = rel - mean[cg]
    # sum_i d_i sum_t y_it: with one b per class, d_i = -mean for all its rollouts.
    cross = -mean * sum_y if rollout_y is None else per_class(d * rollout_y)
    centred = ops.maximum(per_class(tokens * d * d) + 2.0 * cross + y2, 0.0)
    std = xp.sqrt(centred / ops.maximum(n - 1.0, 1.0))
    denominator = std + epsilon
    contrast = xp.concatenate([group_contrast, group_contrast])
    usable = contrast & (members > 1) & (denominator > 0)
    scale = xp.where(usable, 1.0 / xp.where(usable, denominator, 1.0), 0.0)
    rms = xp.sqrt(y2 / n1)
    wide = usable & (
        ((std <= 1e-3 * rms) & (rms > 0)) | ~xp.isfinite(y2) | (varying & (rollout_y is None))
    )
    return scale, d * scale[cg], wide


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
) -> TokenShaping:
    """GTPO's shaped token rewards and advantages (the module's formulas).

    entropy: H_it (nats), (N,). The token passes are float32; sums over keys and classes, and
    the class statistics, float64. A class whose answer float32 cannot give (nearly flat shaped
    rewards, outcome terms b_i that differ: rewards other than 0/1) is computed again in
    float64, and only its tokens take that answer, so that a request's answer does not depend on
    the requests merged with it.
    """
    if entropy.device.type == "cpu" and batch.num_tokens and not with_reward:
        fast = _gtpo_compiled(batch, entropy, alpha1, alpha2, correct_threshold, epsilon)
        if fast is not None:
            return fast
    shaping, wide_classes, of_token = _gtpo(
        batch, entropy, torch.float32, alpha1, alpha2, correct_threshold, epsilon, with_reward
    )
    if not bool(wide_classes.any()):
        return shaping
    wide, _, _ = _gtpo(
        batch, entropy, torch.float64, alpha1, alpha2, correct_threshold, epsilon, with_reward
    )
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
) -> TokenShaping | None:
    """GTPO on the CPU by two compiled loops over each rollout's contiguous slice of tokens
    (:mod:`.kernels`): the same float32 arithmetic in the same order as :func:`_gtpo` (the same
    bits); None where that one must decide (an entropy of 0 at some position, a class its
    float32 pass leaves to float64).

    Why: per token, the keyed path builds an int32 key, gathers per-key tables and scatters
    into them; each is a pass over N tokens with a fresh N-sized buffer. Here the keys of
    rollout i's tokens are the range [start_i, start_i + T_i): one loop adds v and v^2 into
    the per-position tables S and Q (and counts the rollouts reaching each position), the
    other writes A = F scale v + shift and takes each rollout's sum while its slice is in
    cache. A group without contrast takes no part in the sums and gets 0."""
    from . import kernels  # (numba is imported when a compiled loop first runs)

    # What split_classes, key_layout and outcome_rewards compute, in numpy (per rollout and per
    # class group: a numpy call costs a microsecond, a torch one several).
    g = batch.num_groups
    offsets = batch.offsets.numpy()
    lengths = np.diff(offsets)
    rewards = batch.rewards.numpy().astype(np.float64)
    correct = rewards > correct_threshold
    wrong = ~correct
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

    h = entropy.float().contiguous().numpy()
    total, squares, alive, factor = kernels.scratch_tables(num_keys, 4)
    negative = kernels.gtpo_position_sums(h, offsets, start, busy, wrong, total, squares, alive)
    status = kernels.gtpo_factor(total, alive, first_wrong, alpha2, factor)
    if status:  # an entropy of 0 where the keyed path's shares decide
        return None
    y2 = kernels.class_square_sums(factor, squares, longest)
    b = np.where(correct, alpha1 * rewards, -alpha1)
    scale, shift, wide = _class_statistics_numpy(
        lengths, cg, contrast, y2, b, alpha2, epsilon, None
    )
    if wide.any():
        return None
    out = np.empty(batch.num_tokens, dtype=np.float32)
    sums = kernels.gtpo_write(
        h,
        offsets,
        start,
        busy,
        wrong,
        negative,
        factor,
        scale.astype(np.float32)[cg],
        shift.astype(np.float32),
        out,
    )
    scalars = sums / np.maximum(lengths.astype(np.float64), 1.0)
    return TokenShaping(torch.from_numpy(out), torch.from_numpy(scalars), None)


def _gtpo(
    batch: RolloutBatch,
    entropy: torch.Tensor,
    dtype: torch.dtype,
    alpha1: float,
    alpha2: float,
    correct_threshold: float,
    epsilon: float,
    with_reward: bool,
) -> tuple[TokenShaping, torch.Tensor, torch.Tensor]:
    """GTPO in ``dtype`` per token, by per-token keys (any device); the classes a float32 pass
    leaves to a float64 one (bool (2G,)); each token's class group (int64 (N,))."""
    classes = split_classes(batch, correct_threshold)
    layout = key_layout(batch, classes)
    alive = layout.alive(batch.lengths)
    key = token_keys(batch, layout)
    v, total = token_shares(entropy, layout, alive, key, dtype)
    squares = torch.zeros_like(total).index_add_(0, key, v * v)
    factor = key_factor(alive, total, layout.first_wrong, alpha2)
    b = outcome_rewards(batch, classes, alpha1)
    y = None
    if with_reward or dtype == torch.float64:
        y = factor.index_select(0, key).mul_(v)
    rollout_y = batch.rollout_sums(y) if dtype == torch.float64 and y is not None else None
    y2 = layout.square_sums(factor, squares)
    norm = normalise(batch, classes, y2, b, alpha2, epsilon, rollout_y)
    scale_of_key = layout.per_key(norm.scale.to(dtype))
    per_key = factor.mul(scale_of_key)
    # (a factor may be infinite where its class is left out: a group without contrast)
    per_key.masked_fill_(scale_of_key == 0, 0.0)
    advantage = per_key.index_select(0, key).mul_(v)
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
