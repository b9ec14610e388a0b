"""The one formula: A_it = a_it w_it + sum_k c_k b^(k)_it, then optional whitening and clipping,
then the terms' amplifications, A_it <- A_it + k_it |A_it| (HICRA), then the terms' masks,
A_it <- m_it A_it, then, with the outcome's ``zero_signal: "zero"``, A_it <- 0 on every token
of a group whose rewards are all equal.

a_it is the outcome baseline's a_i on every token of rollout i, or, for an outcome that is per
token (OTB, GTPO), its own a_it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..batch import RolloutBatch
from ..errors import RequestError
from .registry import OUTCOMES, TERMS, OutcomeOutput, TermContext, TermOutput
from .spec import EstimatorSpec, resolve_estimator

WHITEN_EPS = 1e-8
PER_ROLLOUT_DIAGNOSTICS = ("scalar",)


def all_diagnostics() -> tuple[str, ...]:
    """Every diagnostic a request may ask for in ``return``."""
    return (
        PER_ROLLOUT_DIAGNOSTICS
        + tuple(d for t in TERMS.values() for d in t.diagnostics)
        + tuple(d for o in OUTCOMES.values() for d in o.diagnostics)
    )


def estimator_diagnostics(spec: EstimatorSpec) -> tuple[str, ...]:
    """The diagnostics ``spec`` produces: ``scalar``, its terms' and its outcome's."""
    return (
        PER_ROLLOUT_DIAGNOSTICS
        + tuple(d for t in spec.terms for d in TERMS[t].diagnostics)
        + OUTCOMES[spec.outcome].diagnostics
    )


@dataclass
class AdvantageResult:
    """Per-token advantages (N,) float32, per-rollout scalars (B,) float32, requested
    diagnostics (name -> (N,) float32), on the device they were computed on."""

    advantages: torch.Tensor
    scalars: torch.Tensor
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    estimator: EstimatorSpec | None = None
    # Term name -> its TermOutput.state, for the writes of the terms that keep state.
    state: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise RequestError("invalid_parameter", f"unknown device {device!r}", field="device")
    return torch.device(device)


def whiten(values: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """(A - mean) / sqrt(var + 1e-8) over all values, var unbiased (0 for fewer than 2).

    ``counts`` (the values' shape, integers): each value stands for that many, as a rollout's
    one advantage stands for each of its tokens; the statistics are those of the values so
    repeated, without repeating them (none at all: the values as they are)."""
    if counts is not None:
        return _whiten_counted(values, counts)
    if values.numel() == 0:
        return values
    # Statistics in float64: a float32 sum over millions of tokens loses digits.
    wide = values.double()
    var = wide.var(unbiased=True) if values.numel() > 1 else wide.new_zeros(())
    return ((wide - wide.mean()) / torch.sqrt(var + WHITEN_EPS)).to(values.dtype)


def _whiten_counted(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    n = int(counts.sum())
    if n == 0:
        return values
    wide = values.double()
    weights = counts.double()
    mean = (wide * weights).sum() / n
    var = (weights * (wide - mean) ** 2).sum() / (n - 1) if n > 1 else wide.new_zeros(())
    return ((wide - mean) / torch.sqrt(var + WHITEN_EPS)).to(values.dtype)


def clip(values: torch.Tensor, bound: float) -> torch.Tensor:
    """``values`` clamped to [-bound, bound]."""
    # A bound past the dtype's range clips nothing (and torch refuses to convert it).
    bound = min(bound, torch.finfo(values.dtype).max)
    return values.clamp(-bound, bound)


def whiten_and_clip(
    advantages: torch.Tensor,
    spec: EstimatorSpec,
    counts: torch.Tensor | None = None,
    *,
    clipped: bool = True,
) -> torch.Tensor:
    """The formula's whitening (``spec.whiten``) then clipping (``spec.clip``) of one request's
    advantages: every estimator's, whether the pipeline computes them per token or the padded
    API per row (``counts``: each row's tokens, see :func:`whiten`). ``clipped`` False: no
    clipping (done already, while broadcasting)."""
    if spec.whiten:
        advantages = whiten(advantages, counts)
    if clipped and spec.clip is not None:
        advantages = clip(advantages, spec.clip)
    return advantages


def require_inputs(
    batch: RolloutBatch,
    what: str,
    requires: Mapping[str, str],
    otherwise: Mapping[str, str] | None = None,
) -> None:
    """Raise ``missing_input`` for the first input of ``requires`` (batch input -> request
    field, as estimators declare them) that the batch lacks; ``what`` names the estimator;
    ``otherwise``: input -> how else the service could have it (said in the message)."""
    for need, field_name in requires.items():
        if not batch.has_input(need):
            how = (otherwise or {}).get(need)
            raise RequestError(
                "missing_input",
                f"{what} needs {field_name} on every rollout" + (f" (or {how})" if how else ""),
                field=field_name,
            )


def derivable_inputs(batch: RolloutBatch, spec: EstimatorSpec) -> list[str]:
    """The inputs the estimator's terms need, the batch lacks, and the terms can make from the
    token ids with a tokenizer (:func:`derive_inputs`)."""
    out: list[str] = []
    for name, params in spec.terms.items():
        term = TERMS[name]
        needs = term.requires(params)
        out += [n for n in term.derives if n in needs and not batch.has_input(n) and n not in out]
    return out


def derive_inputs(
    batch: RolloutBatch, spec: EstimatorSpec, vocabulary: Sequence[str] | None
) -> RolloutBatch:
    """``batch`` with the inputs the estimator's terms need and can make themselves
    (:class:`~.registry.Derivation`) from the token ids, where the batch lacks them and the
    server has a tokenizer (``vocabulary[id]``: what id decodes to alone). An input the request
    gave is never replaced. Returns ``batch`` itself when nothing is made."""
    if vocabulary is None or not derivable_inputs(batch, spec):
        return batch
    made: dict[str, Any] = {}
    for name, params in spec.terms.items():
        term = TERMS[name]
        for need, derivation in term.derives.items():
            if need in made or batch.has_input(need) or need not in term.requires(params):
                continue
            made[need] = derivation.derive(batch, params, vocabulary)
    if not made:
        return batch
    return replace(batch, **made)


def rollout_means(batch: RolloutBatch, values: torch.Tensor) -> torch.Tensor:
    """Per rollout, the mean of its tokens' ``values`` (N,): float64 (B,), 0 for an empty
    rollout."""
    return batch.rollout_sums(values) / batch.lengths.clamp(min=1)


def check_inputs(batch: RolloutBatch, spec: EstimatorSpec, diagnostics: Iterable[str]) -> None:
    """Raise RequestError when the batch lacks what the estimator or diagnostics need."""
    outcome = OUTCOMES[spec.outcome]
    if outcome.min_group_size > 1 and batch.num_groups:
        small = torch.nonzero(batch.group_sizes < outcome.min_group_size)
        if small.numel():
            gid = batch.group_ids[int(small[0])]
            raise RequestError(
                "group_too_small",
                f"{spec.outcome} needs at least {outcome.min_group_size} rollouts per group; "
                f"group {gid!r} has {int(batch.group_sizes[int(small[0])])}",
                group_id=gid,
                field="rollouts",
            )
    require_inputs(
        batch, f"outcome baseline {spec.outcome!r}", outcome.requires(spec.outcome_params)
    )
    for name, params in spec.terms.items():
        term = TERMS[name]
        otherwise = {need: d.how for need, d in term.derives.items()}
        require_inputs(batch, f"estimator term {name!r}", term.requires(params), otherwise)
    if outcome.check_batch is not None:
        outcome.check_batch(batch, spec.outcome_params)
    available = set(estimator_diagnostics(spec))
    for d in diagnostics:
        if d not in available:
            known = all_diagnostics()
            why = (
                "the term or outcome that produces it is not in the estimator"
                if d in known
                else f"known diagnostics: {list(known)}"
            )
            raise RequestError("invalid_parameter", f"cannot return {d!r}: {why}", field="return")


def zero_signal_rollouts(batch: RolloutBatch, spec: EstimatorSpec) -> torch.Tensor | None:
    """bool (B,): the rollouts whose advantage the estimator's ``zero_signal: "zero"`` sets to 0
    on every token (those of a group whose rewards are all equal, ``batch.zero_signal``), after
    the terms, whitening, clipping and masks; None when it keeps them (the default)."""
    if spec.outcome_params.get("zero_signal", "keep") != "zero" or not batch.num_groups:
        return None
    return batch.zero_signal[batch.group_index]


def _tensor(value: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    """A diagnostic, computed now if it was left for when asked for."""
    return value if isinstance(value, torch.Tensor) else value()


def _fused_amplification(
    batch: RolloutBatch,
    spec: EstimatorSpec,
    outputs: Iterable[TermOutput],
    diagnostics: frozenset[str],
) -> TermOutput | None:
    """The one amplification (HICRA) that can be applied while a per-rollout a_i is broadcast
    over the tokens, on the CPU: where nothing else makes the advantage differ between a
    rollout's tokens before it (no weight, bonus or whitening; clipping applies to a_i alike),
    and where what it added is not asked for. A_it = a_i + k |a_i| m_it is then one pass writing
    the answer (:func:`.kernels.broadcast_amplified`) instead of a broadcast and a pass reading
    and writing it again: the same float32 operations."""
    if batch.tokens.device.type != "cpu" or spec.whiten:
        return None
    outputs = list(outputs)
    if any(out.weight is not None or out.bonus is not None for out in outputs):
        return None
    amplifying = [out for out in outputs if out.amplification is not None]
    if len(amplifying) != 1 or amplifying[0].amplification_diagnostic in diagnostics:
        return None
    return amplifying[0]


def _broadcast_amplified(
    batch: RolloutBatch, a: torch.Tensor, bound: float | None, fused: TermOutput
) -> torch.Tensor:
    """a_i (float32 (B,)) clipped, broadcast over each rollout's tokens and amplified by
    ``fused``: float32 (N,), the bits of a broadcast, a clip and the amplification after."""
    if bound is not None:
        a = clip(a, bound)
    assert fused.amplification is not None
    from . import kernels  # (numba is imported when a compiled loop first runs)

    out = torch.empty(batch.num_tokens, dtype=torch.float32)
    kernels.broadcast_amplified(
        a.contiguous().numpy(),
        batch.offsets.numpy(),
        fused.amplification.float().contiguous().numpy(),
        fused.amplification_scale,
        out.numpy(),
    )
    return out


def compute_batch(
    batch: RolloutBatch,
    estimator: str | Mapping[str, Any] | EstimatorSpec | None = None,
    device: str | torch.device = "cpu",
    *,
    diagnostics: Iterable[str] | str | None = (),
    ignore_token_ids: Any = None,
    vocab_size: int | None = None,
    context: TermContext | None = None,
) -> AdvantageResult:
    """Per-token advantages for a validated flat batch.

    ``diagnostics``: the names to return in ``.diagnostics``, as a request's ``return`` asks
    for them; only those are computed (default: none; ``"all"``: every one the estimator's
    terms and outcome produce, :func:`estimator_diagnostics`; None as the default).
    ``.scalars`` is always there.
    Returns tensors on ``device`` (``auto``: CUDA when available).
    """
    spec = resolve_estimator(estimator)
    # The server computes only what a request's `return` asks for; so does the library: the
    # statistics diagnostics cost more than the advantages they explain.
    if isinstance(diagnostics, str):
        diagnostics = estimator_diagnostics(spec) if diagnostics == "all" else (diagnostics,)
    wanted = tuple(dict.fromkeys(() if diagnostics is None else diagnostics))
    check_inputs(batch, spec, wanted)
    dev = resolve_device(device)
    batch = batch.to(dev)
    ctx = context or TermContext()
    if ignore_token_ids is not None:
        ctx.ignore_token_ids = torch.as_tensor(ignore_token_ids, dtype=torch.int64, device=dev)
    ctx.vocab_size = vocab_size
    ctx.diagnostics = frozenset(wanted)

    outcome = OUTCOMES[spec.outcome].fn(batch, spec.outcome_params)
    if not isinstance(outcome, OutcomeOutput):
        outcome = OutcomeOutput(outcome)
    # A term that waits for a read still in flight runs last, so that the others overlap the
    # wait; outputs are combined in the estimator's order either way.
    run_order = sorted(spec.terms, key=ctx.waits)
    computed = {
        name: TERMS[name].fn(batch, spec.terms[name], ctx.for_term(name)) for name in run_order
    }
    outputs = {name: computed[name] for name in spec.terms}
    fused: TermOutput | None = None  # an amplification applied while broadcasting a_i
    # a_it w_it + sum_k c_k b_it in float32 (the output precision), built in place in one fresh
    # tensor: weights scale only the outcome term, never a bonus, so they go first.
    produced: dict[str, torch.Tensor | Callable[[], torch.Tensor]] = dict(outcome.diagnostics)
    if OUTCOMES[spec.outcome].per_token:
        # Per token: the rollout's scalar is its mean a_it.
        scalars = (
            outcome.scalars
            if outcome.scalars is not None
            else rollout_means(batch, outcome.advantage)
        )
        # (an outcome's float32 advantage is the pipeline's to write into: no copy)
        advantages = outcome.advantage.to(torch.float32)
    else:
        scalars = outcome.advantage  # float64 (B,)
        fused = _fused_amplification(batch, spec, outputs.values(), ctx.diagnostics)
        if fused is not None:
            advantages = _broadcast_amplified(batch, scalars.float(), spec.clip, fused)
        else:
            advantages = batch.per_token(scalars.float())
    for out in outputs.values():
        if out.weight is not None:
            advantages.mul_(out.weight)
    for out in outputs.values():
        if out.bonus is not None:
            advantages.add_(out.bonus)
    produced.update({k: v for out in outputs.values() for k, v in out.diagnostics.items()})
    state = {name: out.state for name, out in outputs.items() if out.state is not None}
    # (a fused amplification clipped a_i already, while broadcasting it)
    clipped = fused is None
    # Whitening is over each request's tokens (a merged batch holds several).
    spans = batch.spans() if spec.whiten else []
    if len(spans) > 1:
        advantages = torch.cat(
            [whiten_and_clip(advantages[s.tokens], spec, clipped=clipped) for s in spans]
        )
    else:
        advantages = whiten_and_clip(advantages, spec, clipped=clipped)
    # Amplifications of the combined advantage (HICRA): after whitening and clipping, so that
    # A_it + k |A_it| is exactly what the term's paper states of the advantage it is given.
    for out in outputs.values():
        if out.amplification is None or out is fused:
            continue
        if out.amplification_diagnostic in ctx.diagnostics:
            added = advantages.abs().mul_(out.amplification).mul_(out.amplification_scale)
            produced[out.amplification_diagnostic] = added
            advantages.add_(added)
        elif advantages.device.type == "cpu":
            # One pass in place (torch: a fresh |A| and an addcmul_ reading three arrays).
            from . import kernels  # (numba is imported when a compiled loop first runs)

            advantages = advantages.contiguous()
            kernels.amplify(
                advantages.numpy(),
                out.amplification.contiguous().numpy(),
                out.amplification_scale,
            )
        else:
            advantages.addcmul_(advantages.abs(), out.amplification, value=out.amplification_scale)
    # Masks last: a masked token carries nothing, whatever the formula, whitening or clip gave.
    for out in outputs.values():
        if out.mask is not None:
            advantages.masked_fill_(~out.mask, 0.0)
    zero = zero_signal_rollouts(batch, spec)
    if zero is not None:
        advantages.masked_fill_(batch.per_token(zero.to(torch.int32)).bool(), 0.0)
        scalars = scalars.masked_fill(zero, 0.0)
    return AdvantageResult(
        advantages=advantages,
        scalars=scalars.float(),
        diagnostics={d: _tensor(produced[d]).float() for d in wanted if d != "scalar"},
        estimator=spec,
        state=state,
    )
