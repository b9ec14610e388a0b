"""The cells of the integration matrix and what each is checked against.

A cell is (integration, preset, the per-token inputs given). The presets and the inputs each
reads come from the service's own listing (required and optional), so a new method or input
gets its cells without editing this file; each integration gets only the inputs its trainer
has: an input the trainer cannot give makes no cell (a preset that requires it, none at all).
Optional inputs make a cell with and one without each.

Every cell's answer is compared with ``advantage_service.compute_padded`` (the library, in this
process) on the inputs the test put in the trainer's batch, so an input the integration drops
or a transport loses shows as a difference.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

# Every input a per-token estimator may read, by compute_padded keyword.
ALL_INPUTS = frozenset(
    (
        "logprobs",
        "entropy",
        "sum_pi_squared",
        "is_weights",
        "returns",
        "planning_mask",
        "teacher_logprobs",
    )
)
# What each trainer can give. verl: every input (returns is its reward-to-go, always sent to an
# estimator that reads it). TRL: its old log-probs or the extra forward pass (logprobs, entropy,
# sum_pi_squared), vLLM's importance-sampling ratio (is_weights), the teacher hook; it has no
# per-token rewards (returns) and no planning mask.
HAS = {
    "plain": ALL_INPUTS,
    "verl": ALL_INPUTS,
    "trl": frozenset(("logprobs", "entropy", "sum_pi_squared", "is_weights", "teacher_logprobs")),
}
# Inputs a trainer always sends to an estimator reading them (no cell without).
ALWAYS = {"plain": frozenset(), "verl": frozenset(("returns",)), "trl": frozenset()}
# TRL's own GRPO divides by (std + 1e-4); the service's grpo preset uses 1e-6.
TRL_GRPO = {"outcome": {"name": "grpo", "epsilon": 1e-4}}
# Relative tolerance: |A - A_ref| <= TOL * max |A_ref|.
TOL = 1e-5


@dataclass(frozen=True)
class Cell:
    integration: str
    preset: str
    inputs: tuple[str, ...]  # the inputs given (sorted)
    variant: str = ""  # how the trainer holds one of them (verl: entropys or entropy)

    @property
    def id(self) -> str:
        given = "+".join(self.inputs) or "none"
        return f"{self.preset}[{given}]{'/' + self.variant if self.variant else ''}"


def _listing() -> dict[str, Any]:
    from advantage_service.wire.listing import estimator_listing

    return dict(estimator_listing())


def reads(preset: str) -> tuple[set[str], set[str]]:
    """(required, optional) inputs of a preset, by compute_padded keyword, from the listing."""
    from advantage_client.integrations import checks

    listing = _listing()
    full = checks.resolve(listing, preset)
    required = {n.split(".", 1)[0] for n in checks.required_inputs(listing, full)}
    optional = {n.split(".", 1)[0] for n in checks.optional_inputs(listing, full)} - required
    return required, optional


def per_token_presets() -> list[str]:
    """The presets that read a per-token input."""
    return [p for p in _listing()["presets"] if any(reads(p))]


def cells(integration: str) -> list[Cell]:
    has, always = HAS[integration], ALWAYS[integration]
    out = []
    for preset in per_token_presets():
        required, optional = reads(preset)
        if not required <= has:
            continue
        choosable = sorted((optional & has) - always)
        for chosen in itertools.product((False, True), repeat=len(choosable)):
            given = (
                required
                | (optional & always)
                | {n for n, c in zip(choosable, chosen, strict=True) if c}
            )
            inputs = tuple(sorted(given))
            variants: tuple[str, ...] = ("",)
            if integration == "verl" and "entropy" in given:
                variants = ("entropys", "entropy")  # (the legacy trainer's key, the v1 trainer's)
            if integration == "trl" and "logprobs" in given:
                variants = ("old_per_token_logps", "extra_forward")
            out += [Cell(integration, preset, inputs, v) for v in variants]
    # the outcome every trainer has its own of (checked against it too)
    out.append(Cell(integration, "grpo", ()))
    return out


# ---- batches ------------------------------------------------------------------------------------


@dataclass
class Batch:
    """A padded batch as a trainer holds it, float32 like a trainer's tensors."""

    tokens: np.ndarray  # int64 (B, T)
    mask: np.ndarray  # bool (B, T)
    token_rewards: np.ndarray  # float32 (B, T), spread over each response (0 off the mask)
    group_ids: np.ndarray  # object (B,) of str
    inputs: dict[str, np.ndarray]  # every per-token input but returns, float32 (B, T)
    teachers: dict[str, np.ndarray]  # condition -> float32 (B, T)

    @property
    def rewards(self) -> np.ndarray:
        return self.token_rewards.astype(np.float64).sum(axis=1)

    @property
    def returns(self) -> np.ndarray:
        """The reward-to-go of each token (verl's, and OTB's G_t), float64."""
        r = self.token_rewards.astype(np.float64) * self.mask
        return np.flip(np.cumsum(np.flip(r, axis=1), axis=1), axis=1)


def random_batch(seed: int, sizes: tuple[int, ...] = (4, 3, 5, 2), width: int = 9) -> Batch:
    rng = np.random.default_rng(seed)
    group_ids = np.array([f"g{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    order = rng.permutation(group_ids.size)  # (a group's rows are not adjacent)
    group_ids = group_ids[order]
    b = group_ids.size
    lengths = rng.integers(2, width + 1, size=b)
    mask = np.arange(width)[None, :] < lengths[:, None]
    tokens = np.where(mask, rng.integers(10, 60, size=(b, width)), 0).astype(np.int64)
    # an outcome per row (some rows right, some wrong) plus a small per-token shaping
    outcome = rng.integers(0, 2, size=b).astype(np.float64)
    token_rewards = rng.normal(0, 0.1, size=(b, width)) * mask
    last = lengths - 1
    token_rewards[np.arange(b), last] += outcome
    uniform = rng.uniform
    inputs = {
        "logprobs": -uniform(0.01, 3.0, size=(b, width)),
        "entropy": uniform(0.0, 3.0, size=(b, width)),
        "sum_pi_squared": uniform(0.05, 1.0, size=(b, width)),
        "is_weights": uniform(0.2, 2.0, size=(b, width)),
        "planning_mask": (rng.random((b, width)) < 0.3).astype(np.float64),
    }
    teachers = {c: -uniform(0.01, 3.0, size=(b, width)) for c in ("pos", "neg")}
    return Batch(
        tokens=tokens,
        mask=mask,
        token_rewards=token_rewards.astype(np.float32),
        group_ids=group_ids,
        inputs={k: v.astype(np.float32) for k, v in inputs.items()},
        teachers={k: v.astype(np.float32) for k, v in teachers.items()},
    )


def reference(
    tokens: Any,
    mask: np.ndarray,
    rewards: np.ndarray,
    group_ids: np.ndarray,
    estimator: Any,
    inputs: dict[str, np.ndarray],
    teachers: dict[str, np.ndarray] | None = None,
) -> np.ndarray:
    """The in-process library's advantages (float64) for these inputs."""
    import advantage_service

    result = advantage_service.compute_padded(
        tokens,
        np.asarray(mask, dtype=bool),
        np.asarray(rewards, dtype=np.float64),
        group_ids,
        estimator=estimator,
        teacher_logprobs=teachers or None,
        **inputs,
    )
    return as_numpy(result.advantages).astype(np.float64)


def given_inputs(cell: Cell, batch: Batch) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(per-token inputs, teacher log-probs) of the cell, from the batch."""
    per_token: dict[str, np.ndarray] = {}
    for name in cell.inputs:
        if name == "returns":
            per_token[name] = batch.returns
        elif name != "teacher_logprobs":
            per_token[name] = batch.inputs[name]
    teachers = dict(batch.teachers) if "teacher_logprobs" in cell.inputs else {}
    return per_token, teachers


def as_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)


def assert_close(got: Any, expected: Any, label: str) -> None:
    """``got`` equals ``expected`` within TOL of the largest |expected| (and 0 where both are)."""
    got_np, want = as_numpy(got).astype(np.float64), as_numpy(expected).astype(np.float64)
    assert got_np.shape == want.shape, f"{label}: shape {got_np.shape} != {want.shape}"
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-6)
    worst = float(np.abs(got_np - want).max(initial=0.0))
    off = np.abs(got_np - want) > TOL * scale
    assert worst <= TOL * scale, (
        f"{label}: off by {worst:.3g} (max |A| {scale:.3g}); got {got_np[off][:6]}, "
        f"want {want[off][:6]}"
    )
