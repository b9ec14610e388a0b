"""Forking tokens (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
Effective Reinforcement Learning for LLM Reasoning").

Only the highest-entropy tokens, the "forking tokens" where the policy's reasoning branches,
carry the policy gradient. m_it = 1 if H_it >= tau, with tau the (1 - rho) quantile of the
entropies of the request's tokens (scope ``request``, what TRL's ``get_high_entropy_mask`` does
over its batch) or of the group's (scope ``group``). In a batch that merges requests
(``RolloutBatch.concat``), each request is its own pool for scope ``request``. As an estimator
term the mask applies last, after the one formula, whitening and clipping: A_it <- m_it A_it.

The quantile is ``torch.quantile``'s, linear interpolation between two order statistics, to the
bit: the rank q (n - 1) is computed in float32 from float32(q) and the interpolation is
``torch.lerp``, as ``torch.quantile`` does for float32 input. ``torch.quantile`` itself refuses
more than 2^24 elements and sorts its input; here the request scope selects the two order
statistics with ``kthvalue``, and the group scope (or a merged batch's requests) sorts once by
(pool, entropy) keys, with no limit on the size. Past 2^24 elements, where float32 can no
longer hold the rank to a fraction, the rank and the interpolation are float64 (numpy's
``linear`` method).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..batch import RolloutBatch
from .registry import Param, TermContext, TermOutput, register_term

SCOPES = ("request", "group")

# torch.quantile's input limit; up to it the rank is float32, as torch.quantile computes it.
FLOAT32_RANK_LIMIT = 2**24


def _check(rho: float, scope: str) -> None:
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho must lie in (0, 1], got {rho}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")


def linear_ranks(q: float, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The order statistics the q quantile of ``counts`` (S,) values interpolates between.

    Returns (below, above, weight): int64 (S,) 0-based ranks and the float64 (S,) weight of
    ``above``. For counts up to 2^24 the rank is float32(q) * float32(n - 1) rounded to
    float32, exactly torch.quantile's; above, q * (n - 1) in float64. Counts of 0 give rank 0.
    """
    last = (counts - 1).clamp(min=0)
    rank = (torch.tensor(q, dtype=torch.float32, device=counts.device) * last.float()).double()
    big = counts > FLOAT32_RANK_LIMIT
    if bool(big.any()):
        rank = torch.where(big, q * last.double(), rank)
    below = rank.floor().long()
    above = rank.ceil().long()
    return below, above, rank - below.double()


def interpolate(
    below: torch.Tensor, above: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """lerp(below, above, weight) as float64: in float32 (torch.quantile's rounding, exact in
    float64) where ``counts`` <= 2^24, in float64 beyond."""
    small = torch.lerp(below.float(), above.float(), weight.float()).double()
    big = counts > FLOAT32_RANK_LIMIT
    if not bool(big.any()):
        return small
    return torch.where(big, torch.lerp(below.double(), above.double(), weight), small)


def request_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The q quantile of float32 ``values`` (n,) with linear interpolation, float64 0-d.

    The two order statistics come from ``kthvalue`` (a selection, not a sort); n = 0 gives inf.
    """
    n = values.numel()
    if n == 0:
        return torch.tensor(torch.inf, dtype=torch.float64, device=values.device)
    counts = torch.tensor([n])
    below, above, weight = linear_ranks(q, counts)
    lo, hi = int(below[0]), int(above[0])
    x_lo = torch.kthvalue(values, lo + 1).values
    x_hi = x_lo if hi == lo else torch.kthvalue(values, hi + 1).values
    return interpolate(
        x_lo.reshape(1), x_hi.reshape(1), weight.to(values.device), counts.to(values.device)
    )[0]


def orderable_bits(values: torch.Tensor) -> torch.Tensor:
    """int64 (N,) in [0, 2^32) that sort as float32 ``values`` do (sign-magnitude to two's
    complement: a negative float's magnitude bits are flipped)."""
    bits = values.view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() + 2**31


def segment_quantiles(
    values: torch.Tensor, segment: torch.Tensor, num_segments: int, q: float
) -> torch.Tensor:
    """Per segment, the q quantile of float32 ``values`` (N,) whose segment is ``segment``
    (int64 (N,) in [0, S)), with linear interpolation: float64 (S,), inf for an empty segment.

    One sort of (segment, value) keys lays every segment out in order; each segment's two order
    statistics are then at its start plus its ranks.
    """
    counts = torch.bincount(segment, minlength=num_segments)
    if values.numel() == 0:
        return torch.full((num_segments,), torch.inf, dtype=torch.float64, device=values.device)
    order = torch.sort((segment << 32) | orderable_bits(values)).indices
    starts = torch.cumsum(counts, 0) - counts
    below, above, weight = linear_ranks(q, counts)
    last = values.numel() - 1
    x_lo = values[order[(starts + below).clamp(max=last)]]
    x_hi = values[order[(starts + above).clamp(max=last)]]
    tau = interpolate(x_lo, x_hi, weight, counts)
    return tau.masked_fill(counts == 0, torch.inf)


def _pools(batch: RolloutBatch, scope: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(pool of each token (N,), pool of each group (G,), number of pools) for the quantile's
    pools of tokens: the groups (scope ``group``) or the requests of a merged batch (scope
    ``request``, ``batch.segments``); None for scope ``request`` over a batch of one request."""
    if scope == "group":
        groups = torch.arange(batch.num_groups, device=batch.device)
        return batch.per_token(batch.group_index), groups, batch.num_groups
    if batch.segments is None:
        return None
    count = batch.segments.numel() - 1
    segment = batch.segment_of_rollout()
    assert segment is not None
    of_group = torch.zeros(batch.num_groups, dtype=torch.int64, device=batch.device)
    of_group.scatter_(0, batch.group_index, segment)
    return batch.per_token(segment), of_group, count


def forking_thresholds(
    batch: RolloutBatch, entropy: torch.Tensor, rho: float = 0.2, scope: str = "request"
) -> torch.Tensor:
    """tau per group, float64 (G,): the (1 - rho) quantile of the entropies of the request's
    tokens (scope ``request``: the same value for every group of a request; each request its
    own in a merged batch) or of the group's (``group``); inf where the pool has no tokens.

    entropy: (N,), taken as float32 (the per-token dtype; TRL takes ``.float()`` too).
    """
    _check(rho, scope)
    h = entropy.float()
    pools = _pools(batch, scope)
    if pools is None:
        return request_quantile(h, 1.0 - rho).expand(batch.num_groups).clone()
    of_token, of_group, count = pools
    return segment_quantiles(h, of_token, count, 1.0 - rho).index_select(0, of_group)


def forking_mask(
    batch: RolloutBatch, entropy: torch.Tensor, rho: float = 0.2, scope: str = "request"
) -> torch.Tensor:
    """m_it = H_it >= tau: bool (N,), True for the forking tokens that keep their advantage.

    entropy: (N,) per-token entropies (nats), taken as float32; rho in (0, 1] is the fraction
    kept (rho = 1 keeps every token); scope ``request`` or ``group`` (see
    :func:`forking_thresholds`).
    """
    _check(rho, scope)
    h = entropy.float()
    pools = _pools(batch, scope)
    if pools is None:
        tau = request_quantile(h, 1.0 - rho)
    else:
        of_token, _, count = pools
        tau = segment_quantiles(h, of_token, count, 1.0 - rho).index_select(0, of_token)
    # Up to 2^24 values tau is a float32 (exact in float64): compare in float32. Past it, a
    # float64 tau must not be rounded to float32, which could move it onto an order statistic.
    if h.numel() <= FLOAT32_RANK_LIMIT:
        return h >= tau.float()
    return h.double() >= tau


# ---- the term -----------------------------------------------------------------------------------

PARAMS = (
    Param(
        "rho",
        float,
        0.2,
        "the fraction of tokens kept: those at or above the (1 - rho) entropy quantile",
        minimum=0.0,
        exclusive_minimum=True,
        maximum=1.0,
    ),
    Param(
        "scope",
        str,
        "request",
        "the tokens the quantile is taken over: the request's (as TRL does over its batch) or "
        "each group's",
        choices=SCOPES,
    ),
)


@register_term(
    "forking",
    formula="A_it <- m_it A_it (last), m_it = [H_it >= tau], tau = the (1 - rho) quantile of H",
    paper="Wang et al. 2025, Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive "
    "Effective Reinforcement Learning for LLM Reasoning",
    params=PARAMS,
    diagnostics=("forking_mask",),
    requires=lambda params: {"entropy": "entropy"},
)
def forking(batch: RolloutBatch, params: Mapping[str, Any], ctx: TermContext) -> TermOutput:
    """Keeps the advantage of the highest-entropy (forking) tokens only."""
    assert batch.entropy is not None  # guaranteed by `requires`
    m = forking_mask(batch, batch.entropy, params["rho"], params["scope"])
    return TermOutput(mask=m, diagnostics={"forking_mask": m})
