"""GTPO's class statistics (:mod:`.gtpo`, Eq. 6): each class's mean and sample standard deviation
of its shaped rewards over its own tokens in the group, from per-key and per-rollout sums (no
pass over the tokens), as the scale and shift that turn a token's entropy share into its
advantage, and the classes a float32 pass leaves to a float64 one. The same float64 arithmetic
runs on numpy arrays on the CPU and on torch tensors elsewhere.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ..batch import RolloutBatch
from .gtpo_shaping import Classes

# A class whose std is at most this share of its entropy part's root mean square goes to the
# float64 pass. Why this value: A = (y - mean) / std, so the float32 token pass (v = H or 1/H
# rounded, A = (F scale) v + shift) errs by a few float32 ulps of y / std, about 2e-7 rms / std
# in absolute terms, where the answer must stay within 1e-5 of the float64 computation (of the
# group's largest |A|, at least 1): rms / std <= 50 keeps it there with room.
WIDE_BELOW = 2e-2


# Eq. 6's scopes: each class over its own tokens in the group (the paper's equation), or over
# its tokens in the request (the authors' own runs: "our current implementation operates at
# the batch level"). The batch is the request, never a batch the scheduler merged.
SCOPES = ("group", "request")


class Pools(NamedTuple):
    """Scope ``request``: the class groups pooled, per request (a segment of a merged batch)
    and class: ``of_class_group`` int64 (2G,), the pool of each class group (the layout of
    class groups: O+ pools, then O- pools; groups without contrast in a pool of their own,
    last of each half); ``contrast`` bool (P,), the pools that take part (all but that one)."""

    # (numpy arrays; torch tensors on the device of a batch computed elsewhere)
    of_class_group: Any
    contrast: Any


def request_pools(batch: RolloutBatch, group_contrast: np.ndarray) -> Pools:
    """The pools of scope ``request`` (:class:`Pools`): a class group with contrast pools with
    the same class of its request's other groups."""
    segment, requests = batch.request_of_rollout()
    of_group = np.zeros(batch.num_groups, np.int64)
    of_group[batch.group_index.cpu().numpy()] = segment.cpu().numpy()
    own = np.where(group_contrast, of_group, requests)
    return Pools(np.concatenate([own, own + requests + 1]), np.arange(requests + 1) < requests)


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
    pools: Pools | None = None,
) -> Normalisation:
    """Each class's mean and sample std of r~_it = b_i + y_it over its own tokens in the group
    (Eq. 6; with ``pools``, over its tokens in the request), from per-key sums: y sums to
    +-alpha2 d_t at each key (the shares sum to 1), so a class's sum of y is +-alpha2 n_c (n_c
    its tokens); its sum of y^2 is ``y2`` = sum_k F_k^2 Q_k, with Q_k the sum of v^2 at key k
    (:meth:`.gtpo_shaping.KeyLayout.square_sums`). Where
    the b_i of a class differ (rewards other than 0/1), the cross terms need each rollout's sum
    of y (``rollout_y``, float64 (B,)); without it those classes are ``wide``.

    A class of one rollout has r~ = b + alpha2 on every token (its share is 1 at each position):
    its std is 0 and so is its advantage, set here exactly (float32 rounding of y would
    otherwise be divided by eps). A class whose std is at most :data:`WIDE_BELOW` of its entropy
    part's root mean square (shares nearly alike: the float32 token pass's rounding, divided by
    std + eps, would show) is ``wide``, as are classes whose sum of squares overflowed.

    Every array here has a value per rollout or per class group: on the CPU numpy's (a call
    costs a microsecond; torch's several), elsewhere torch's."""
    if b.device.type == "cpu":
        scale, shift, wide = class_statistics_numpy(
            batch.lengths.numpy(),
            classes.class_group.numpy(),
            classes.contrast.numpy(),
            y2.numpy(),
            b.numpy(),
            alpha2,
            epsilon,
            None if rollout_y is None else rollout_y.numpy(),
            pools,
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
            None if pools is None else _on(pools, b.device),
        )
    )


def _on(pools: Pools, device: torch.device) -> Pools:
    return Pools(
        torch.from_numpy(pools.of_class_group).to(device),
        torch.from_numpy(pools.contrast).to(device),
    )


def class_statistics_numpy(
    lengths: np.ndarray,
    cg: np.ndarray,
    group_contrast: np.ndarray,
    y2: np.ndarray,
    b: np.ndarray,
    alpha2: float,
    epsilon: float,
    rollout_y: np.ndarray | None,
    pools: Pools | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`normalise`'s arithmetic on the CPU from the rollouts' lengths (T_i, int (B,)):
    the compiled loop both CPU paths share (:func:`.gtpo_kernels.class_statistics`, the same
    float64 operations in the same order as :func:`_class_statistics`), so that the group at a
    time loop and the keyed path give the same bits."""
    from . import gtpo_kernels  # (numba is imported when a compiled loop first runs)

    if pools is not None:
        pooled = np.zeros(pools.contrast.shape[0] * 2, np.float64)
        np.add.at(pooled, pools.of_class_group, y2)
        scale, shift, wide = class_statistics_numpy(
            lengths, pools.of_class_group[cg], pools.contrast, pooled, b, alpha2, epsilon,
            rollout_y, None,
        )  # fmt: skip
        return scale[pools.of_class_group], shift, wide[pools.of_class_group]
    num = y2.shape[0]
    scale, wide, shift = np.empty(num), np.empty(num, np.bool_), np.empty(b.shape[0])
    gtpo_kernels.class_statistics(
        lengths.astype(np.int64, copy=False),
        np.arange(b.shape[0]),
        cg.astype(np.int64, copy=False),
        np.concatenate([group_contrast, group_contrast]),
        y2,
        b,
        alpha2,
        epsilon,
        WIDE_BELOW,
        np.empty(0) if rollout_y is None else rollout_y,
        scale,
        wide,
        shift,
    )
    return scale, shift, wide


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
    pools: Pools | None,
) -> tuple[Any, Any, Any]:
    """:func:`normalise`'s arithmetic on per-rollout and per-class-group tensors of a device
    other than the CPU (``xp``: :class:`_TorchOps`): (scale, shift, wide). With ``pools``, the
    classes are the pools (their sums of squares added up), their scale and wide flag handed
    back to each class group of theirs."""
    if pools is not None:
        pooled = xp.zeros(pools.contrast.shape[0] * 2, xp.float64)
        xp.add_at(pooled, pools.of_class_group, y2)
        scale, shift, wide = _class_statistics(
            xp,
            tokens,
            has_tokens,
            pools.of_class_group[cg],
            pools.contrast,
            pooled,
            b,
            alpha2,
            epsilon,
            rollout_y,
            None,
        )
        return scale[pools.of_class_group], shift, wide[pools.of_class_group]
    num_cg = y2.shape[0]
    g = num_cg // 2

    def per_class(values: Any) -> Any:
        out = xp.zeros(num_cg, xp.float64)
        xp.add_at(out, cg, values)
        return out

    n = per_class(tokens)
    members = per_class(has_tokens)
    sign = xp.full(num_cg, 1.0, xp.float64)
    sign[g:] = -1.0
    sum_y = sign * alpha2 * n
    # Centred on b_ref, one b_i of the class: with 0/1 rewards every b_i - b_ref is 0 exactly,
    # and so is the mean's outcome part (a mean of equal values in floating point may not be).
    b_ref = xp.full(num_cg, -np.inf, xp.float64)
    xp.max_at(b_ref, cg, b)
    rel = b - b_ref[cg]
    varying = per_class(abs(rel)) > 0
    n1 = xp.maximum(n, 1.0)
    mean = (per_class(rel * tokens) + sum_y) / n1
    d = rel - mean[cg]
    # sum_i d_i sum_t y_it: with one b per class, d_i = -mean for all its rollouts.
    cross = -mean * sum_y if rollout_y is None else per_class(d * rollout_y)
    centred = xp.maximum(per_class(tokens * d * d) + 2.0 * cross + y2, 0.0)
    std = xp.sqrt(centred / xp.maximum(n - 1.0, 1.0))
    denominator = std + epsilon
    contrast = xp.concatenate([group_contrast, group_contrast])
    usable = contrast & (members > 1) & (denominator > 0)
    scale = xp.where(usable, 1.0 / xp.where(usable, denominator, 1.0), 0.0)
    rms = xp.sqrt(y2 / n1)
    wide = usable & (
        ((std <= WIDE_BELOW * rms) & (rms > 0)) | ~xp.isfinite(y2) | (varying & (rollout_y is None))
    )
    return scale, d * scale[cg], wide
