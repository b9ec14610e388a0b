"""The flat ragged batch every layer below the transports works on.

Layout (the one varlen attention kernels use): all rollouts' tokens concatenated into ``tokens``
(N,), rollout ``i`` owning ``tokens[offsets[i]:offsets[i + 1]]``; ``group_index`` (B,) gives each
rollout's dense group number into ``group_ids``. No padding anywhere.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from advantage_contract.fields import REWARD_COMPONENTS_FIELD, TOKEN_FIELDS

from ..errors import RequestError
from . import validation
from .merge import concat_components, concat_token_inputs

# The optional per-token inputs beside the teachers' log-probabilities, each float32 (N,) or
# None: the contract's per-token fields. They travel wherever logprobs travels.
TOKEN_INPUTS = TOKEN_FIELDS


def _to_tensor(value: Any, dtype: torch.dtype, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value
    else:
        try:
            tensor = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError) as exc:
            raise RequestError(
                "invalid_type", f"{name} is not a numeric array: {exc}", field=name
            ) from exc
    if tensor.dim() != 1:
        raise RequestError(
            "invalid_shape",
            f"{name} must be one-dimensional, got shape {tuple(tensor.shape)}",
            field=name,
        )
    if dtype in (torch.int32, torch.int64) and tensor.is_floating_point():
        raise RequestError("invalid_type", f"{name} must hold integers", field=name)
    if tensor.dtype == torch.bool:
        raise RequestError("invalid_type", f"{name} must be numeric, not boolean", field=name)
    return tensor.to(dtype)


def _token_tensor(value: Any) -> torch.Tensor:
    """Token ids as a tensor to check. int32 ids in memory nobody can write (a view of an
    Arrow request's body) are used where they lie: no copy, and nothing changes them while the
    statistics of the request are written after its answer. Other ids are copied, widened to
    int64, so that an id past int32's range is refused by the range check, not wrapped around
    by the narrowing after it."""
    if isinstance(value, np.ndarray) and value.dtype == np.int32 and _immutable(value):
        return _to_tensor(value, torch.int32, "tokens")
    return _to_tensor(value, torch.int64, "tokens")


def _immutable(array: np.ndarray) -> bool:
    """Whether ``array``'s memory is a ``bytes`` object's or Arrow's (an array's, or a buffer
    that is not mutable), through read-only views only: a read-only view of a writable array,
    or of a mutable Arrow buffer, is not."""
    base: Any = array
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    if isinstance(base, bytes):
        return True
    # (by module name: the batch does not import pyarrow)
    return type(base).__module__.split(".")[0] == "pyarrow" and not getattr(
        base, "is_mutable", False
    )


def repeat_runs(values: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """``values[i]`` repeated over positions [starts[i], starts[i + 1]) of a fresh (total,)
    tensor; ``starts`` strictly increasing from 0 (non-empty runs covering every position).

    On the CPU numpy's ``repeat`` (a copy per run, several times torch's on one thread). On an
    accelerator, for int64, int32 and float32, differences of the values (of their bit
    patterns, for float32) are scattered at the run starts and summed up: one cumulative sum,
    exact (integer arithmetic), and cheaper than the index ``repeat_interleave`` builds and
    gathers by. Other dtypes take ``repeat_interleave``.
    """
    if values.device.type == "cpu":
        bounds = starts.numpy()
        counts = np.empty(bounds.size, dtype=np.int64)
        np.subtract(bounds[1:], bounds[:-1], out=counts[:-1])
        counts[-1:] = total - bounds[-1:]
        return torch.from_numpy(np.repeat(values.numpy(), counts))
    return repeat_by_cumsum(values, starts, total)


def repeat_by_cumsum(values: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """:func:`repeat_runs` by one cumulative sum of differences (the accelerators' way)."""
    dtype = values.dtype
    if dtype == torch.float32:
        bits = values.view(torch.int32).long()
    elif dtype in (torch.int64, torch.int32):
        bits = values.long()
    else:
        ends = torch.empty_like(starts)
        ends[:-1] = starts[1:]
        ends[-1:] = total
        return torch.repeat_interleave(values, ends - starts, output_size=total)
    delta = bits.clone()
    delta[1:] -= bits[:-1]
    out = torch.zeros(total, dtype=torch.int64, device=values.device)
    # (scatter_, not out[starts] = delta: the starts are distinct, and it is ~3x faster on CPU)
    out.scatter_(0, starts, delta)
    torch.cumsum(out, 0, out=out)
    if dtype == torch.int64:
        return out
    out32 = out.to(torch.int32)
    return out32.view(torch.float32) if dtype == torch.float32 else out32


def fresh(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor. On the CPU numpy allocates it: numpy asks the kernel for huge
    pages for arrays of 4 MiB and more, where a fresh torch tensor takes a page fault per 4 KiB
    page on first touch (about 2.5 ms per 4 MiB on one core: more than most passes over it)."""
    if device.type == "cpu":
        return torch.from_numpy(np.empty(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class Span:
    """Where one request lies in a merged batch: its rollouts, groups and tokens."""

    rollout_lo: int
    rollout_hi: int
    group_lo: int
    group_hi: int
    token_lo: int
    token_hi: int

    @property
    def rollouts(self) -> slice:
        return slice(self.rollout_lo, self.rollout_hi)

    @property
    def groups(self) -> slice:
        return slice(self.group_lo, self.group_hi)

    @property
    def tokens(self) -> slice:
        return slice(self.token_lo, self.token_hi)


@dataclass(eq=False)
class RolloutBatch:
    """Groups of rollouts as flat tensors.

    tokens: int32 (N,); offsets: int64 (B+1,); group_index: int64 (B,) in [0, G);
    group_ids: G distinct strings; rewards: float32 (B,); logprobs, entropy, sum_pi_squared,
    is_weights, planning_mask: float32 (N,) or None (:data:`TOKEN_INPUTS`); teacher_logprobs:
    condition name -> float32 (N,); reward_components: component name -> float32 (B,), NaN where
    a rollout has no value for it.
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    group_index: torch.Tensor
    group_ids: list[str]
    rewards: torch.Tensor
    logprobs: torch.Tensor | None = None
    teacher_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    # H_it: the entropy of the policy's next-token distribution where y_it was sampled (nats).
    entropy: torch.Tensor | None = None
    # S_it = sum_v pi(v | x, y_<t)^2, in (0, 1].
    sum_pi_squared: torch.Tensor | None = None
    # rho_it >= 0: the trainer's truncated importance weights.
    is_weights: torch.Tensor | None = None
    # G_it: the return from token t on (the reward-to-go, for rewards spread over tokens, e.g.
    # a per-token KL penalty); OTB's G in place of r_i.
    returns: torch.Tensor | None = None
    # m_it in {0, 1}: 1 on the planning (strategic) tokens HICRA amplifies.
    planning_mask: torch.Tensor | None = None
    # Prompt ids for state kept per prompt (history); defaults to the group ids.
    prompt_ids: list[str] | None = None
    # Named rewards per rollout (a format and an accuracy reward, ...), NaN where a rollout gave
    # none (null): left out of that component's statistics, as TRL leaves out None rewards.
    # ``rewards`` stays what every outcome reads.
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    # bool (B,): the rollouts that gave components and no reward, whose reward is the weighted
    # sum of their components (:meth:`with_component_weights` re-weighs them); None: none.
    reward_derived: torch.Tensor | None = None
    # A batch that merges several requests (``concat``): int64 (S+1,) on the CPU, request s owns
    # rollouts [segments[s], segments[s + 1]). None: the batch is one request. Math over "the
    # whole request" (whitening, GPG's B) runs per segment.
    segments: torch.Tensor | None = None

    @classmethod
    def from_flat(
        cls,
        tokens: Any,
        offsets: Any,
        group_ids: Sequence[str],
        group_index: Any,
        rewards: Any,
        logprobs: Any = None,
        teacher_logprobs: Mapping[str, Any] | None = None,
        *,
        entropy: Any = None,
        sum_pi_squared: Any = None,
        is_weights: Any = None,
        returns: Any = None,
        planning_mask: Any = None,
        vocab_size: int | None = None,
        prompt_ids: Sequence[str] | None = None,
        reward_components: Mapping[str, Any] | None = None,
        component_weights: Any = None,
    ) -> RolloutBatch:
        """Build and validate a batch from flat arrays (numpy, torch or lists).

        ``logprobs``, ``entropy``, ``sum_pi_squared``, ``is_weights``, ``returns``,
        ``planning_mask``: (N,) each, or None (named in the signature, for ``help()`` and type
        checkers, though :data:`CARRIED_INPUTS` could derive them).
        ``prompt_ids``: per group, the key of the state kept per prompt (history); None keys it
        by the group ids.
        ``reward_components``: component name -> (B,) values, NaN (or None in a list) where a
        rollout has none. Where it is given, a NaN reward is a missing one: the sum of the
        rollout's components, each times its ``component_weights`` entry (name -> weight; 1
        where it has none).
        Raises :class:`RequestError` naming the group, rollout and field of the first problem.
        """

        def optional(values: Any, name: str) -> torch.Tensor | None:
            return None if values is None else _to_tensor(values, torch.float32, name)

        validation.check_component_names(list(reward_components or {}))
        batch = cls(
            tokens=_token_tensor(tokens),
            offsets=_to_tensor(offsets, torch.int64, "offsets"),
            group_index=_to_tensor(group_index, torch.int64, "group_index"),
            group_ids=[str(g) for g in group_ids],
            rewards=(
                _component_tensor(rewards, "reward")
                if reward_components
                else _to_tensor(rewards, torch.float32, "reward")
            ),
            logprobs=optional(logprobs, "logprobs"),
            teacher_logprobs={
                str(k): _to_tensor(v, torch.float32, f"teacher_logprobs.{k}")
                for k, v in (teacher_logprobs or {}).items()
            },
            entropy=optional(entropy, "entropy"),
            sum_pi_squared=optional(sum_pi_squared, "sum_pi_squared"),
            is_weights=optional(is_weights, "is_weights"),
            returns=optional(returns, "returns"),
            prompt_ids=None if prompt_ids is None else [str(p) for p in prompt_ids],
            planning_mask=optional(planning_mask, "planning_mask"),
            # (in name order, whatever order the wire gave: sums over them then agree bit
            # for bit on every wire)
            reward_components={
                str(k): _component_tensor(v, f"{REWARD_COMPONENTS_FIELD}.{k}")
                for k, v in sorted((reward_components or {}).items())
            },
        )
        validation.check_layout(batch)
        batch.fill_rewards(component_weights or {})
        if batch.prompt_ids is not None and len(batch.prompt_ids) != len(batch.group_ids):
            raise RequestError(
                "invalid_shape",
                f"{len(batch.prompt_ids)} prompt keys for {len(batch.group_ids)} groups",
                field="prompt_key",
            )
        validation.check_values(batch, vocab_size)
        batch.tokens = batch.tokens.to(torch.int32)  # (int32 already: the same tensor)
        return batch

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_rollouts(self) -> int:
        return int(self.rewards.numel())

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    # ---- per-token inputs ----------------------------------------------------------------------

    def token_inputs(self) -> dict[str, torch.Tensor]:
        """The optional per-token inputs the batch carries (name -> (N,)), in
        :data:`TOKEN_INPUTS` order."""
        out = {}
        for name in TOKEN_INPUTS:
            values = getattr(self, name)
            if values is not None:
                out[name] = values
        return out

    def has_input(self, need: str) -> bool:
        """Whether the batch carries ``need``: a name of :data:`TOKEN_INPUTS`, or
        ``teacher:<condition>`` (what estimators declare in ``requires``)."""
        if need.startswith("teacher:"):
            return need.removeprefix("teacher:") in self.teacher_logprobs
        if need in TOKEN_INPUTS:
            return getattr(self, need) is not None
        raise ValueError(f"unknown batch input {need!r}")

    # ---- derived index tensors (computed once per batch, on its device) ------------------------

    @cached_property
    def lengths(self) -> torch.Tensor:
        """int64 (B,): tokens per rollout."""
        return self.offsets[1:] - self.offsets[:-1]

    @cached_property
    def rollout_of_token(self) -> torch.Tensor:
        """int64 (N,): the rollout each token belongs to."""
        return self.per_token(torch.arange(self.num_rollouts, device=self.device))

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """Per-rollout ``values`` (B,) repeated over each rollout's tokens: a fresh (N,) tensor
        (int64, int32 or float32; see :func:`repeat_runs`)."""
        nonempty = self.lengths > 0
        return repeat_runs(values[nonempty], self.offsets[:-1][nonempty], self.num_tokens)

    def rollout_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per rollout, the sum of its tokens' ``values`` (N,), accumulated in float64: float64
        (B,), 0 for an empty rollout. Each rollout's tokens are summed on their own, in order,
        so its sum does not depend on the other rollouts of the batch (a merged batch gives each
        the same bits).

        On the CPU, numpy's ``add.reduceat`` over the contiguous segments, reading float32 values
        in place (a scatter-add by rollout, or a float64 copy, costs several times more);
        elsewhere ``index_add_``.
        """
        out = torch.zeros(self.num_rollouts, dtype=torch.float64, device=values.device)
        if self.num_tokens == 0:
            return out
        if values.device.type != "cpu":
            return out.index_add_(0, self.rollout_of_token, values.double())
        nonempty = torch.nonzero(self.lengths > 0).flatten()
        # Empty rollouts dropped, the starts increase strictly, so each segment ends where the
        # next non-empty rollout starts: its own end.
        starts = self.offsets[:-1].index_select(0, nonempty)
        sums = np.add.reduceat(values.contiguous().numpy(), starts.cpu().numpy(), dtype=np.float64)
        out[nonempty] = torch.from_numpy(sums)
        return out

    def per_token_wide(self, values: torch.Tensor) -> torch.Tensor:
        """Per-rollout float64 ``values`` (B,) repeated over each rollout's tokens: float64 (N,),
        to about 2^-48 of each value (a float32 part and the float32 rest, each repeated exactly
        by :meth:`per_token`)."""
        high = values.float()
        low = (values - high.double()).float()
        out = self.per_token(high).double()
        out += self.per_token(low)
        return out

    @cached_property
    def group_sizes(self) -> torch.Tensor:
        """int64 (G,): rollouts per group."""
        return torch.bincount(self.group_index, minlength=self.num_groups)

    @cached_property
    def rank_in_group(self) -> torch.Tensor:
        """int64 (B,): the rollout's position among its group's rollouts, in batch order."""
        order = torch.sort(self.group_index, stable=True).indices
        starts = torch.cumsum(self.group_sizes, 0) - self.group_sizes
        rank = torch.empty_like(self.group_index)
        rank[order] = (
            torch.arange(self.num_rollouts, device=self.device) - starts[self.group_index[order]]
        )
        return rank

    @cached_property
    def zero_signal(self) -> torch.Tensor:
        """bool (G,): every rollout of the group has the same reward, so GRPO-style estimators
        give it no signal."""
        lo = torch.full((self.num_groups,), torch.inf, device=self.device)
        hi = torch.full((self.num_groups,), -torch.inf, device=self.device)
        lo = lo.scatter_reduce(0, self.group_index, self.rewards.float(), "amin")
        hi = hi.scatter_reduce(0, self.group_index, self.rewards.float(), "amax")
        return lo == hi

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch on ``device`` (derived tensors are recomputed there lazily)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return RolloutBatch(
            tokens=self.tokens.to(device, non_blocking=True),
            offsets=self.offsets.to(device, non_blocking=True),
            group_index=self.group_index.to(device, non_blocking=True),
            group_ids=self.group_ids,
            rewards=self.rewards.to(device, non_blocking=True),
            teacher_logprobs={
                k: v.to(device, non_blocking=True) for k, v in self.teacher_logprobs.items()
            },
            prompt_ids=self.prompt_ids,
            segments=self.segments,
            reward_components={
                k: v.to(device, non_blocking=True) for k, v in self.reward_components.items()
            },
            reward_derived=(
                None if self.reward_derived is None else self.reward_derived.to(device)
            ),
            **{k: v.to(device, non_blocking=True) for k, v in self.token_inputs().items()},
        )

    def fill_rewards(self, weights: Mapping[str, float]) -> None:
        """Where the batch has reward components, each NaN reward (none given) becomes the sum
        of the rollout's components times ``weights`` (1 where a name has none); a rollout
        without a value of any is refused."""
        if not self.reward_components:
            return
        missing = torch.isnan(self.rewards)
        if bool(missing.any()):
            self.reward_derived = missing
            self.rewards = validation.summed_rewards(
                self.rewards, missing, self.reward_components, weights
            )
            _refuse_rewardless(self)

    def with_component_weights(self, weights: Mapping[str, float]) -> RolloutBatch:
        """This batch with the rewards derived from components (rollouts that gave none)
        summed with ``weights`` (name -> weight; 1 where a name has none): the estimator's."""
        if self.reward_derived is None or not weights:
            return self
        rewards = validation.summed_rewards(
            self.rewards, self.reward_derived, self.reward_components, weights
        )
        return dataclasses.replace(self, rewards=rewards)

    # ---- requests merged into one batch ---------------------------------------------------------

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """One batch holding ``batches`` one after another, each its own request (segment) and
        its groups its own, even where group ids collide. They must carry the same teacher
        conditions. An optional per-token input that some lack is filled with its neutral
        value where it has one (:data:`.merge.NEUTRAL_VALUES`), else dropped. Reward
        components: the union of the names, NaN (none) for the rollouts of a request that lacks
        one."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        device = first.device
        rollouts = torch.tensor([b.num_rollouts for b in batches])
        groups = torch.tensor([0] + [b.num_groups for b in batches]).cumsum(0)
        tokens = torch.tensor([0] + [b.num_tokens for b in batches]).cumsum(0).to(device)
        offsets = torch.cat(
            [first.offsets[:1]] + [b.offsets[1:] + tokens[i] for i, b in enumerate(batches)]
        )
        group_index = torch.cat([b.group_index + int(groups[i]) for i, b in enumerate(batches)])
        per_prompt = any(b.prompt_ids is not None for b in batches)
        return cls(
            tokens=torch.cat([b.tokens for b in batches]),
            offsets=offsets,
            group_index=group_index,
            group_ids=[gid for b in batches for gid in b.group_ids],
            rewards=torch.cat([b.rewards for b in batches]),
            **concat_token_inputs(batches),
            teacher_logprobs={
                name: torch.cat([b.teacher_logprobs[name] for b in batches])
                for name in first.teacher_logprobs
            },
            prompt_ids=(
                [p for b in batches for p in (b.prompt_ids or b.group_ids)] if per_prompt else None
            ),
            **concat_components(batches),
            segments=torch.cat([torch.zeros(1, dtype=torch.int64), rollouts.cumsum(0)]),
        )

    def spans(self) -> list[Span]:
        """The rollouts, groups and tokens of each request the batch holds (one without
        segments). A request's groups are contiguous: ``concat`` keeps them so."""
        if self.segments is None:
            return [Span(0, self.num_rollouts, 0, self.num_groups, 0, self.num_tokens)]
        bounds = self.segments.tolist()
        offsets = self.offsets.cpu()
        index = self.group_index.cpu()
        spans: list[Span] = []
        for lo, hi in itertools.pairwise(bounds):
            g_lo = int(index[lo]) if hi > lo else (spans[-1].groups.stop if spans else 0)
            g_hi = int(index[hi - 1]) + 1 if hi > lo else g_lo
            spans.append(Span(lo, hi, g_lo, g_hi, int(offsets[lo]), int(offsets[hi])))
        return spans

    def segment_of_rollout(self) -> torch.Tensor | None:
        """int64 (B,): the request of each rollout (None for a batch of one request)."""
        if self.segments is None:
            return None
        sizes = self.segments[1:] - self.segments[:-1]
        segment = torch.arange(sizes.numel()).repeat_interleave(sizes)
        return segment.to(self.device)

    def request_of_rollout(self) -> tuple[torch.Tensor, int]:
        """Each rollout's request, int64 (B,) (all 0 for a batch of one request), and how many
        requests the batch holds: what a statistic over "the batch" sums over, a request of a
        merged batch on its own."""
        segment = self.segment_of_rollout()
        if segment is None or self.segments is None:
            return torch.zeros_like(self.group_index), 1
        return segment, int(self.segments.numel()) - 1

    # ---- validation ----------------------------------------------------------------------------

    def locate_rollout(self, rollout: int, field: str) -> dict[str, Any]:
        """Keyword arguments for a RequestError about rollout ``rollout`` (batch index)."""
        return {
            "group_id": self.group_ids[int(self.group_index[rollout])],
            "rollout_index": int(self.rank_in_group[rollout]),
            "field": field,
        }

    def token_position(self, position: int) -> tuple[int, int]:
        """(rollout, index within that rollout) of flat token ``position``."""
        rollout = int(torch.searchsorted(self.offsets, position, right=True)) - 1
        return rollout, position - int(self.offsets[rollout])

    def locate_token(self, position: int, field: str) -> dict[str, Any]:
        return self.locate_rollout(self.token_position(position)[0], field)

    def validate(self, *, vocab_size: int | None = None) -> None:
        """Check shapes and values; raise RequestError for the first problem found
        (:mod:`.validation`)."""
        validation.validate(self, vocab_size)


# The per-token inputs this service version's batch carries, in :data:`TOKEN_INPUTS` order (a
# newer contract's input it lacks is refused where one is given).
CARRIED_INPUTS = tuple(
    name for name in TOKEN_INPUTS if name in {f.name for f in dataclasses.fields(RolloutBatch)}
)


def _component_tensor(values: Any, name: str) -> torch.Tensor:
    """A component's per-rollout values as float32 (B,); None in a list is NaN (no value)."""
    if isinstance(values, list | tuple):
        values = [np.nan if v is None else v for v in values]
    return _to_tensor(values, torch.float32, name)


def _refuse_rewardless(batch: RolloutBatch) -> None:
    """The first rollout that gave neither a reward nor a value of any component."""
    given = torch.zeros(batch.num_rollouts, dtype=torch.bool, device=batch.device)
    for values in batch.reward_components.values():
        given |= ~torch.isnan(values)
    assert batch.reward_derived is not None
    bad = torch.nonzero(batch.reward_derived & ~given)
    if bad.numel():
        raise RequestError(
            "missing_input",
            "reward is missing and every reward component is null; give a reward or a value "
            "of some component",
            **batch.locate_rollout(int(bad[0]), "reward"),
        )
