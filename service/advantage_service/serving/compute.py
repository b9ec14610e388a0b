"""One request's computation, its finiteness check and its summary: what the engine and the
in-process API (:func:`compute`, re-exported as ``advantage_service.compute``) share."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..batch import RolloutBatch
from ..batch.validation import all_finite
from ..errors import RequestError
from ..estimators import AdvantageResult, TermContext, compute_batch, resolve_device
from ..wire.request import ComputeRequest, parse_request
from ..wire.response import build_response
from .term_state import reads_state


def compute_request(
    req: ComputeRequest, device: str | torch.device = "auto", context: TermContext | None = None
) -> AdvantageResult:
    """Run a decoded request's estimator on ``device``."""
    return compute_batch(
        req.batch,
        req.estimator,
        device,
        diagnostics=req.returns,
        ignore_token_ids=req.ignore_token_ids or None,
        vocab_size=req.vocab_size,
        context=context,
    )


def check_finite(req: ComputeRequest, result: AdvantageResult) -> None:
    """Raise RequestError when a result value is NaN or infinite.

    Valid inputs give finite values; extreme parameters can overflow float32 (``opsd.coef`` of
    1e308) or divide zero by zero (``epsilon`` 0 on a group of equal rewards). JSON cannot carry
    such a value, and a trainer must not train on one, so the request is refused and located.
    """
    batch = req.batch
    per_token = {"advantages": result.advantages, **result.diagnostics}
    for name, values in per_token.items():
        if all_finite(values):
            continue
        p = int(torch.nonzero(~torch.isfinite(values))[0])
        rollout, token = batch.token_position(p)
        raise RequestError(
            "non_finite_result",
            f"the estimator gave {name}[{token}] = {float(values[p])}; its parameters are "
            "too extreme for this data (float32)",
            **batch.locate_rollout(rollout, "estimator"),
        )
    if not all_finite(result.scalars):
        i = int(torch.nonzero(~torch.isfinite(result.scalars))[0])
        raise RequestError(
            "non_finite_result",
            f"the estimator gave a non-finite scalar ({float(result.scalars[i])}); its "
            "parameters are too extreme for this data",
            **batch.locate_rollout(i, "estimator"),
        )


def summarize(
    req: ComputeRequest,
    device: torch.device,
    compute_ms: float,
    history: str = "none",
    batch_requests: int = 1,
    recorded: bool | None = None,
    group_history: list[str] | None = None,
) -> dict[str, Any]:
    """The response's summary. ``recorded``: whether the service's writer accepted the
    request's statistics (None: nothing is recorded, as in-process). ``group_history``: per
    group, what its history read gave (the JSON answer puts it on each group)."""
    batch = req.batch
    summary = {
        "tokens": batch.num_tokens,
        "rollouts": batch.num_rollouts,
        "groups": batch.num_groups,
        "zero_signal_groups": int(batch.zero_signal.sum()) if batch.num_groups else 0,
        "device": device.type,
        "compute_ms": round(compute_ms, 3),
        "history": history,
        "batch_requests": batch_requests,
        "recorded": recorded,
    }
    if group_history is not None:
        summary["group_history"] = group_history
    if batch.reward_components:
        summary["reward_components"] = component_statistics(batch)
    return summary


def component_statistics(batch: RolloutBatch) -> dict[str, dict[str, float | None]]:
    """Per reward component of a request: the mean and std of its rollouts' values, those
    without one left out; std with Bessel's correction (TRL logs ``rewards/<name>/std`` so).
    None where no rollout (std: fewer than two) has a value."""
    out: dict[str, dict[str, float | None]] = {}
    for name in sorted(batch.reward_components):
        values = batch.reward_components[name].detach().double().cpu()
        values = values[~torch.isnan(values)]
        count = int(values.numel())
        out[name] = {
            "mean": float(values.mean()) if count else None,
            "std": float(values.std()) if count > 1 else None,
        }
    return out


def compute(request: Mapping[str, Any], device: str = "auto") -> dict[str, Any]:
    """The HTTP JSON request in, the JSON response out (numpy float32 arrays for lists).

    Raises :class:`advantage_service.RequestError` for a request the service would answer 422.
    """
    req = parse_request(request)
    # History lives in the service's stats store; in-process there is none to read.
    history = "unavailable" if reads_state(req) else "none"
    dev = resolve_device(device)
    start = time.perf_counter()
    result = compute_request(req, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    check_finite(req, result)
    elapsed = (time.perf_counter() - start) * 1000.0
    return build_response(req, result, summarize(req, dev, elapsed, history))
