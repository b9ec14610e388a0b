"""GTPO's token-level shaping (:mod:`.gtpo`): the split of each group's rollouts into the correct
(O+) and the wrong (O-) ones, the outcome part b_i of the shaped reward, and the keyed machinery
of the entropy part: dense (class group, position) keys, each token's key, its share v_it /
S_t of its position (the cases of entropies of 0 as :mod:`.gtpo`'s docstring states them) and
the per-key factor F_t. Every function here is a pass over the batch's rollouts, keys or
tokens with no loop in Python; :mod:`.gtpo` puts them together.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..batch import RolloutBatch


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
            from . import gtpo_kernels  # (numba is imported when a compiled loop first runs)

            return torch.from_numpy(
                gtpo_kernels.class_square_sums(
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
    entropy 0) or infinite (some O- entropy 0), the cases :mod:`.gtpo`'s docstring states. Every
    key has a rollout that reaches it (a class group's keys span its longest rollout)."""
    h = clamp_entropy(entropy).to(dtype)
    first_wrong, num_keys = layout.first_wrong, layout.num_keys
    v = torch.reciprocal(h)
    torch.where(key >= first_wrong, v, h, out=v)
    total = torch.zeros(num_keys, dtype=torch.float64, device=v.device)
    total.index_add_(0, key, v if dtype == torch.float64 else v.double())
    flat = total[:first_wrong] == 0
    if bool(flat.any()):  # every O+ token at the position has H = 0: equal shares
        every = torch.zeros(num_keys, dtype=torch.bool, device=v.device)
        every[:first_wrong] = flat
        v.masked_fill_(every.index_select(0, key), 1.0)
        total = torch.where(every, alive.double(), total)
    if bool(torch.isinf(total[first_wrong:]).any()):  # some O- token has H = 0: they share
        certain = torch.isinf(total)
        zero = torch.isinf(v).to(dtype)
        zeros = torch.zeros(num_keys, dtype=torch.float64, device=v.device)
        zeros.index_add_(0, key, zero.double())
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
