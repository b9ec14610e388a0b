"""``compute_padded``: advantages for a trainer's (B, T) padded batch, in-process.

The same signature and result as the clients' ``compute_padded`` (``advantage_contract.padded``
holds the layout both share): a rollout's tokens are the positions where ``mask`` is true (left
padding, right padding, holes), rows of one group need not be adjacent, and the answer is (B, T)
with exact zeros off the mask. Given torch tensors it answers torch tensors on their device (and
computes there); given numpy arrays, numpy arrays.

Two paths, chosen by the estimator:

- no token-level term (the outcome baselines): the per-row scalars are all there is, so nothing
  is gathered: the lengths come from the mask, the scalars (whitened and clipped over the
  request's tokens as the flat pipeline does) are broadcast over each row's mask, as verl's own
  outcome estimators do;
- token-level terms (KTAE, CSCR, OPSD): the tokens and per-token inputs are gathered through the
  mask into the flat batch, computed by :func:`compute_batch`, and scattered back. On the CPU the
  gather and scatter are numpy's boolean indexing over views of the tensors (several times
  faster than torch's on the CPU); on CUDA, torch's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from advantage_contract.arrays import torch_tensor
from advantage_contract.errors import AdvantageError
from advantage_contract.flat import group_prompt_keys, prompt_ids
from advantage_contract.padded import (
    PaddedLayout,
    PaddedResult,
    as_numpy,
    group_index_of,
    row_components,
)

from ..batch import CARRIED_INPUTS, RolloutBatch, fresh
from ..batch.validation import component_weights
from ..errors import RequestError
from ..estimators import OUTCOMES, compute_batch, resolve_estimator
from ..estimators.pipeline import check_inputs, whiten_and_clip, zero_signal_rollouts

__all__ = ["PaddedResult", "compute_padded"]


def _token_level(spec: Any) -> bool:
    """Whether the estimator reads more than the rows' lengths and rewards: a token-level term,
    an outcome that is per token (OTB, GTPO), or one that reads a per-token input (GRPO-S)."""
    outcome = OUTCOMES[spec.outcome]
    return (
        bool(spec.terms)
        or bool(getattr(outcome, "per_token", False))
        or bool(outcome.requires(spec.outcome_params))
    )


class _Padded:
    """The (B, T) side of one call: the mask on the device, and, for a gather on the CPU, its
    numpy view for numpy's (faster) boolean indexing. ``gather``: whether tokens will be
    gathered (a token-level estimator); without, a torch mask is only counted and multiplied."""

    def __init__(self, mask: Any, rewards: Any, group_ids: Any, gather: bool = True) -> None:
        self.torch = isinstance(mask, torch.Tensor)
        self.device = mask.device if isinstance(mask, torch.Tensor) else torch.device("cpu")
        self.cuda = self.device.type != "cpu"
        if isinstance(mask, torch.Tensor) and (self.cuda or not gather):
            if mask.dim() != 2:
                raise RequestError(
                    "invalid_shape", f"mask must be (B, T), got {tuple(mask.shape)}", field="mask"
                )
            self.mask_raw = mask
            self.mask_t = mask if mask.dtype == torch.bool else mask != 0 if gather else mask
            names, index = group_index_of(group_ids)
            b = self.mask_t.shape[0]
            if index.shape != (b,):
                raise RequestError(
                    "invalid_shape",
                    f"group_ids must have {b} entries (one per row), got {index.size}",
                    field="group_ids",
                )
            self.group_ids = names
            self.group_index = torch.as_tensor(index, device=self.device)
            self.rewards = torch.as_tensor(rewards, device=self.device).double()
            if self.rewards.shape != (b,):
                raise RequestError(
                    "invalid_shape",
                    f"rewards must have shape ({b},), got {tuple(self.rewards.shape)}",
                    field="rewards",
                )
            self.layout: PaddedLayout | None = None
        else:
            layout = PaddedLayout.from_padded(mask, rewards, group_ids)
            self.layout = layout
            # (a JAX array's view is read-only: torch_tensor copies it rather than warn)
            self.mask_t = torch_tensor(layout.mask)
            self.mask_raw = self.mask_t
            self.group_ids = layout.group_ids
            self.group_index = torch.from_numpy(layout.group_index)
            self.rewards = torch_tensor(np.ascontiguousarray(layout.rewards))
            self.lengths = torch.from_numpy(layout.lengths)

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """int64 (B,): each row's tokens. Counted on first use: a pass over the whole mask,
        which an outcome of rewards and groups alone (GRPO, RLOO, ...) never needs."""
        # (a bool mask summed as bytes, a 0/1 mask summed: 3-5x faster than count_nonzero
        # on the CPU)
        if self.mask_t.dtype == torch.bool:
            return self.mask_t.view(torch.uint8).sum(1, dtype=torch.int32).long()
        if self.mask_t.is_floating_point():
            return torch.count_nonzero(self.mask_t, dim=1)
        return self.mask_t.sum(1, dtype=torch.int64)

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        """int64 (B+1,): where each row's tokens start in the flat batch, then the total."""
        offsets = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(self.lengths, 0, out=offsets[1:])
        return offsets

    def gather(self, values: Any, name: str) -> torch.Tensor:
        """(B, T) values at the mask: (N,) on the device."""
        if self.layout is not None:
            return torch_tensor(self.layout.gather(values, name))
        tensor = torch.as_tensor(values, device=self.device)
        if tensor.shape != self.mask_t.shape:
            raise RequestError(
                "invalid_shape",
                f"{name} must have the mask's shape {tuple(self.mask_t.shape)}, got "
                f"{tuple(tensor.shape)}",
                field=name,
            )
        return tensor[self.mask_t]

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """(N,) float32 back into (B, T), exactly 0 off the mask."""
        if self.layout is not None:
            return torch.from_numpy(self.layout.scatter(flat.numpy()))
        out = torch.zeros(self.mask_t.shape, dtype=torch.float32, device=self.device)
        out[self.mask_t] = flat
        return out

    def broadcast(self, per_row: torch.Tensor) -> torch.Tensor:
        """(B,) float32 over each row's mask, exactly 0 off it: (B, T)."""
        if self.layout is not None:
            return torch.from_numpy(self.layout.broadcast(per_row.numpy()))
        column = per_row.to(torch.float32).unsqueeze(1)
        if self.mask_raw.dtype == torch.float64:
            return (column * self.mask_raw).to(torch.float32)
        # Into fresh memory with huge pages on the CPU: a (B, T) answer is megabytes, and their
        # page faults would cost about as much as the pass that fills them.
        out = fresh(tuple(self.mask_raw.shape), torch.float32, self.device)
        if self.mask_raw.dtype == torch.bool:
            return torch.where(self.mask_raw, column, column.new_zeros(()), out=out)
        # A 0/1 mask: the product verl's outcome estimators take.
        return torch.mul(column, self.mask_raw, out=out)

    def out(self, tensor: torch.Tensor) -> Any:
        """A result as the caller's kind: the tensor, or numpy for numpy inputs."""
        return tensor if self.torch else tensor.numpy()


def _prompt_ids(padded: _Padded, prompt_keys: Any) -> list[str] | None:
    """Per group, the key of its history from per-row ``prompt_keys`` (checked as the clients
    check them: one per row, every row of a group the same); None when not given."""
    if prompt_keys is None:
        return None
    rows = as_numpy(prompt_keys, "prompt_keys")
    b = int(padded.group_index.numel())
    if rows.shape != (b,):
        raise RequestError(
            "invalid_shape",
            f"prompt_keys must have {b} entries (one per row), got shape {rows.shape}",
            field="prompt_key",
        )
    keys = [None if k is None else str(k) for k in rows.tolist()]
    index = padded.group_index.cpu().numpy()
    return prompt_ids(padded.group_ids, group_prompt_keys(keys, padded.group_ids, index))


class _RowsBatch(RolloutBatch):
    """The outcome-only path's batch: the rows' rewards and groups, with the token counts and
    offsets (a pass over the whole (B, T) mask) made only if something reads them (OPO's
    length weights, whitening); the token ids, which no outcome reads, a view of one zero."""

    def __init__(self, padded: _Padded, components: dict[str, torch.Tensor]) -> None:
        self._padded = padded
        super().__init__(
            tokens=_UNSET,
            offsets=_UNSET,
            group_index=padded.group_index,
            group_ids=padded.group_ids,
            rewards=padded.rewards.float(),
            reward_components=components,
        )

    @property
    def offsets(self) -> torch.Tensor:
        return self._padded.offsets

    @offsets.setter
    def offsets(self, value: torch.Tensor) -> None:  # (the dataclass' __init__: always the mask's)
        pass

    @property
    def tokens(self) -> torch.Tensor:
        num_tokens = int(self._padded.offsets[-1])
        return torch.zeros(1, dtype=torch.int32, device=self._padded.device).expand(num_tokens)

    @tokens.setter
    def tokens(self, value: torch.Tensor) -> None:
        pass


_UNSET = torch.zeros(0)


def _outcome_only(
    padded: _Padded, spec: Any, wanted: tuple[str, ...], components: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (B, T), scalars (B,)) for an estimator without token-level terms: the flat
    pipeline's numbers with nothing gathered (each row's advantages are one value)."""
    batch = _RowsBatch(padded, components)
    batch.fill_rewards(component_weights(spec.outcome_params))
    bad = torch.nonzero(~torch.isfinite(batch.rewards))
    if bad.numel():
        i = int(bad[0])
        raise RequestError(
            "invalid_value",
            f"reward of row {i} is {float(batch.rewards[i])}; it must be finite",
            **batch.locate_rollout(i, "reward"),
        )
    check_inputs(batch, spec, wanted)
    scalars = OUTCOMES[spec.outcome].fn(batch, spec.outcome_params)
    if not isinstance(scalars, torch.Tensor):
        scalars = scalars.advantage  # (a_i, B: an outcome per token takes the flat path)
    # The pipeline's whitening over the request's tokens (each row's value counted once per
    # token: its length, a pass over the mask only when whitening asks for it), then clipping.
    lengths = padded.lengths if spec.whiten else None
    per_row = whiten_and_clip(scalars.float(), spec, lengths)
    zero = zero_signal_rollouts(batch, spec)
    if zero is not None:  # (after whitening and clipping, as the flat pipeline does)
        per_row = per_row.masked_fill(zero, 0.0)
    return padded.broadcast(per_row), scalars.float()


def compute_padded(
    tokens: Any,
    mask: Any,
    rewards: Any,
    group_ids: Any,
    *,
    estimator: Any = "grpo",
    logprobs: Any = None,
    teacher_logprobs: Mapping[str, Any] | None = None,
    entropy: Any = None,
    sum_pi_squared: Any = None,
    is_weights: Any = None,
    returns: Any = None,
    planning_mask: Any = None,
    diagnostics: Sequence[str] = (),
    ignore_token_ids: Sequence[int] | None = None,
    namespace: str | None = None,
    request_id: str | None = None,
    prompt_keys: Any = None,
    reward_components: Mapping[str, Any] | None = None,
) -> PaddedResult:
    """Per-token advantages for a padded batch, computed in this process.

    tokens: int (B, T) token ids (may be None for an estimator with no token-level term);
    mask: bool or 0/1 (B, T), true at each rollout's tokens; rewards: (B,); group_ids: (B,)
    strings, integers or objects naming each row's group, in any order; logprobs and each
    ``teacher_logprobs[condition]``: float (B, T); ``diagnostics``: names to return besides the
    scalars (only those are computed). ``namespace``, ``request_id`` and ``prompt_keys`` (B,:
    per row, the key of its group's history; every row of a group the same) are accepted for the
    clients' signature and checked; in-process there is no stats store to read or write.
    ``reward_components`` {name: (B,)}: named rewards per row, NaN where a row has none; a row
    whose reward is NaN gets their sum, weighted by the estimator's ``weights``.

    Returns :class:`PaddedResult`: ``advantages`` float32 (B, T) with exact zeros off the mask,
    ``scalars`` float32 (B,), ``diagnostics`` {name: float32 (B, T)}: torch tensors on the
    mask's device when given torch tensors, numpy arrays otherwise. Raises
    :class:`RequestError` (the service's 422) for what it will not compute.
    """
    del namespace, request_id  # the service's business: history and idempotency
    spec = resolve_estimator(estimator)
    wanted = tuple(d for d in dict.fromkeys(diagnostics) if d != "scalar")
    per_token = {
        "logprobs": logprobs,
        "entropy": entropy,
        "sum_pi_squared": sum_pi_squared,
        "is_weights": is_weights,
        "returns": returns,
        "planning_mask": planning_mask,
    }
    supported = frozenset(CARRIED_INPUTS)
    for name, values in per_token.items():
        if values is not None and name not in supported:
            raise RequestError(
                "unsupported_input",
                f"{name} is not accepted by this service version yet: its per-token inputs "
                f"are {sorted(supported)}; leave {name} out",
                field=name,
            )
    try:
        token_level = _token_level(spec)
        padded = _Padded(mask, rewards, group_ids, gather=token_level)
        keys = _prompt_ids(padded, prompt_keys)
        components = {
            name: torch.as_tensor(values, dtype=torch.float32, device=padded.device)
            for name, values in row_components(
                reward_components, int(padded.group_index.numel())
            ).items()
        }
        if not token_level:
            advantages, scalars = _outcome_only(padded, spec, wanted, components)
            return PaddedResult(padded.out(advantages), padded.out(scalars), {})
        if tokens is None:
            raise RequestError(
                "missing_input",
                f"estimator {spec.label!r} has token-level terms and needs the token ids",
                field="tokens",
            )
        flat_tokens = padded.gather(tokens, "tokens")
        inputs: dict[str, Any] = {
            name: padded.gather(values, name)
            for name, values in per_token.items()
            if values is not None
        }
        mask_values = inputs.get("planning_mask")
        if mask_values is not None and mask_values.dtype == torch.bool:
            inputs["planning_mask"] = mask_values.float()  # a trainer's bool mask: 0/1
        teachers = {
            str(name): padded.gather(values, f"teacher_logprobs.{name}")
            for name, values in (teacher_logprobs or {}).items()
        }
    except AdvantageError as exc:
        raise RequestError.from_contract(exc) from exc
    logprobs_flat = inputs.pop("logprobs", None)
    batch = RolloutBatch.from_flat(
        tokens=flat_tokens,
        offsets=padded.offsets,
        group_ids=padded.group_ids,
        group_index=padded.group_index,
        rewards=padded.rewards,
        logprobs=logprobs_flat,
        teacher_logprobs=teachers,
        prompt_ids=keys,
        reward_components=components,
        component_weights=component_weights(spec.outcome_params),
        **inputs,
    )
    result = compute_batch(
        batch,
        spec,
        padded.device,
        diagnostics=("scalar", *wanted),
        ignore_token_ids=(
            None if ignore_token_ids is None else as_numpy(ignore_token_ids).reshape(-1).tolist()
        ),
    )
    return PaddedResult(
        advantages=padded.out(padded.scatter(result.advantages)),
        scalars=padded.out(result.scalars),
        diagnostics={name: padded.out(padded.scatter(result.diagnostics[name])) for name in wanted},
    )
