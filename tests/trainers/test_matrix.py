"""The integration matrix: (plain ``compute_padded``, verl's legacy ``compute_advantage``, TRL's
``AdvantageGRPOTrainer`` advantage step) x (inprocess, http, grpc) x (each preset that reads a
per-token input, with each input it reads the trainer has; optional ones with and without).

Each cell's advantages equal the in-process library's for the inputs the test put in the
trainer's batch (an input the integration drops, or a transport loses, shows); where the trainer
has its own estimator of the same math (verl's OTB and GRPO, TRL's GRPO), they equal that too.

verl's v1 trainer (``PPOTrainer._compute_advantage`` behind a transfer queue in a Ray actor,
tests/trainers/test_verl_ray.py) is not in the matrix: starting it costs far more than the whole
matrix; the v1 step calls the same patched ``compute_advantage`` with the batch it fetched.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from advantage_client.integrations import backend
from matrix_support import (
    TRL_GRPO,
    Batch,
    Cell,
    as_numpy,
    assert_close,
    cells,
    given_inputs,
    random_batch,
    reference,
)

TRANSPORTS = [
    "inprocess",
    pytest.param("http", marks=pytest.mark.integration),
    pytest.param("grpc", marks=pytest.mark.integration),
]


def address(request: pytest.FixtureRequest, transport: str) -> str | None:
    """The service's address for a network transport (the session's service starts only for
    those cells)."""
    if transport == "inprocess":
        return None
    service = request.getfixturevalue("service")
    return str(service.url if transport == "http" else service.target)


def cell_params(integration: str) -> list[Any]:
    return [pytest.param(c, id=c.id) for c in cells(integration)]


def estimator_of(cell: Cell) -> Any:
    return TRL_GRPO if cell.integration == "trl" and cell.preset == "grpo" else cell.preset


# ---- plain compute_padded -----------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cell", cell_params("plain"))
def test_plain_compute_padded(request: pytest.FixtureRequest, transport: str, cell: Cell) -> None:
    batch = random_batch(100)
    per_token, teachers = given_inputs(cell, batch)
    expected = reference(
        batch.tokens, batch.mask, batch.rewards, batch.group_ids, cell.preset, per_token, teachers
    )
    chosen = backend(transport, address(request, transport), {})
    result = chosen.compute_padded(
        batch.tokens,
        batch.mask,
        batch.rewards,
        batch.group_ids,
        estimator=cell.preset,
        teacher_logprobs=teachers or None,
        **per_token,
    )
    assert_close(result.advantages, expected, f"plain/{transport}/{cell.id}")
    _check_inputs_matter(cell, batch, expected)


def _check_inputs_matter(cell: Cell, batch: Batch, expected: np.ndarray) -> None:
    """Each optional input given changes the answer on this batch (else its cell with and the
    one without could not tell an integration that drops it)."""
    per_token, _ = given_inputs(cell, batch)
    for name in ("is_weights", "returns"):
        if name in per_token:
            without = {k: v for k, v in per_token.items() if k != name}
            other = reference(
                batch.tokens, batch.mask, batch.rewards, batch.group_ids, cell.preset, without
            )
            scale = float(np.abs(expected).max())
            assert float(np.abs(other - expected).max()) > 100 * 1e-5 * scale, name


# ---- verl's legacy compute_advantage ------------------------------------------------------------

VERL_KEYS = {
    "logprobs": "old_log_probs",
    "sum_pi_squared": "sum_pi_squared",
    "is_weights": "rollout_is_weights",
    "planning_mask": "planning_mask",
}


@pytest.fixture
def verl_registered(request: pytest.FixtureRequest) -> Iterator[Any]:
    """register(transport, url, presets=[preset]) and patch(); unpatch() after."""
    pytest.importorskip("verl.trainer.ppo.ray_trainer")
    from advantage_client.integrations import verl as adv_verl

    transport, cell = request.getfixturevalue("transport"), request.getfixturevalue("cell")
    adv_verl.register(transport, address(request, transport), presets=[cell.preset])
    adv_verl.patch()
    yield adv_verl
    adv_verl.unpatch()


def verl_data(cell: Cell, batch: Batch) -> Any:
    """A DataProto as verl's legacy trainer holds it before the advantage step, with the
    per-token inputs of the cell (and only those) under verl's keys."""
    from verl import DataProto

    tensors: dict[str, torch.Tensor] = {
        "responses": torch.from_numpy(batch.tokens),
        "response_mask": torch.from_numpy(batch.mask).long(),
        "token_level_rewards": torch.from_numpy(batch.token_rewards),
    }
    for name in cell.inputs:
        if name == "entropy":
            tensors[cell.variant] = torch.from_numpy(batch.inputs["entropy"])
        elif name == "teacher_logprobs":
            for condition, values in batch.teachers.items():
                tensors[f"teacher_log_probs.{condition}"] = torch.from_numpy(values)
        elif name in VERL_KEYS:
            tensors[VERL_KEYS[name]] = torch.from_numpy(batch.inputs[name])
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": batch.group_ids.copy()})


def verl_own(cell: Cell, batch: Batch) -> np.ndarray | None:
    """verl's own estimator of the cell's math in float64, where verl has one."""
    from verl.trainer.ppo import core_algos

    rewards = torch.from_numpy(batch.token_rewards).double()
    mask = torch.from_numpy(batch.mask).double()
    if cell.preset == "grpo":
        out, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, batch.group_ids)
        return as_numpy(out)
    if cell.preset == "otb":
        weights = batch.inputs["is_weights"] if "is_weights" in cell.inputs else None
        out, _ = core_algos.compute_optimal_token_baseline_advantage(
            rewards,
            mask,
            batch.group_ids,
            torch.from_numpy(batch.inputs["logprobs"]).double(),
            torch.from_numpy(batch.inputs["sum_pi_squared"]).double(),
            rollout_is_weights=None if weights is None else torch.from_numpy(weights).double(),
        )
        return as_numpy(out)
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cell", cell_params("verl"))
def test_verl_compute_advantage(verl_registered: Any, transport: str, cell: Cell) -> None:
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    batch = random_batch(200)
    out = ray_trainer.compute_advantage(
        verl_data(cell, batch), adv_estimator=f"adv_{cell.preset}", config=AlgoConfig()
    )
    got = out.batch["advantages"]
    label = f"verl/{transport}/{cell.id}"
    per_token, teachers = given_inputs(cell, batch)
    expected = reference(
        batch.tokens, batch.mask, batch.rewards, batch.group_ids, cell.preset, per_token, teachers
    )
    assert_close(got, expected, label)
    own = verl_own(cell, batch)
    if own is not None:
        assert_close(got, own, f"{label} against verl's own")


# ---- TRL's AdvantageGRPOTrainer advantage step --------------------------------------------------


def trl_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Rewards that differ within each group (the tiny model's completions vary in length)."""
    return [float(len(c) % 5) for c in completions]


@pytest.fixture(scope="module")
def trl_step(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real TRL generation step (TRL's own GRPO advantages included): the batch every TRL
    cell's advantage step runs on."""
    pytest.importorskip("trl")
    pytest.importorskip("advantage_service")
    from test_trl_integration import PROMPTS, trainer_of
    from trl import GRPOTrainer

    tmp = tmp_path_factory.mktemp("trl-matrix")
    trainer = trainer_of(tmp, reward=trl_reward, advantage_estimator=TRL_GRPO)
    trainer.model.train()
    inputs = [{"prompt": p} for p in PROMPTS[:2] for _ in range(trainer.num_generations)]
    output = GRPOTrainer._generate_and_score_completions(trainer, inputs)
    assert trainer._rewards_per_func is not None
    mask = output["completion_mask"].bool()
    rng = np.random.default_rng(300)
    shape = tuple(mask.shape)
    return {
        "trainer_of": trainer_of,
        "tmp": tmp,
        "inputs": inputs,
        "output": output,
        "rewards_per_func": trainer._rewards_per_func.clone(),
        "trl_advantages": (output["advantages"][:, None] * mask).double(),
        "old_per_token_logps": torch.from_numpy(-rng.uniform(0.01, 3, size=shape)).float(),
        "importance_sampling_ratio": torch.from_numpy(rng.uniform(0.2, 2, size=shape)).float(),
        "teachers": {
            c: torch.from_numpy(-rng.uniform(0.01, 3, size=shape)).float() for c in ("pos", "neg")
        },
    }


def policy_forward(trainer: Any, output: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's log-probs, entropies and sum of squared probabilities per completion token
    (at TRL's sampling temperature), computed here for the reference."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    width = output["completion_ids"].shape[1]
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=attention).logits
    logp = torch.log_softmax(logits[:, -width - 1 : -1].float() / trainer.temperature, dim=-1)
    p = logp.exp()
    chosen = logp.gather(-1, output["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return {
        "logprobs": chosen,
        "entropy": -(p * logp).sum(-1),
        "sum_pi_squared": (p * p).sum(-1),
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cell", cell_params("trl"))
def test_trl_advantage_step(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    trl_step: dict[str, Any],
    transport: str,
    cell: Cell,
) -> None:
    from trl import GRPOTrainer

    step = trl_step
    forward = {"entropy", "sum_pi_squared"} & set(cell.inputs) or (cell.variant == "extra_forward")
    teachers = step["teachers"]
    trainer = step["trainer_of"](
        step["tmp"],
        reward=trl_reward,
        advantage_estimator=estimator_of(cell),
        advantage_transport=transport,
        advantage_url=address(request, transport),
        advantage_extra_forward=bool(forward),
        # (two iterations per generation: TRL computes the old log-probs itself)
        config_options={"num_iterations": 2} if cell.variant == "old_per_token_logps" else None,
        advantage_teacher_logprobs=(lambda inputs, ids, mask: teachers)
        if "teacher_logprobs" in cell.inputs
        else None,
    )
    extra: dict[str, torch.Tensor] = {}
    if cell.variant == "old_per_token_logps":
        extra["old_per_token_logps"] = step["old_per_token_logps"]
    if "is_weights" in cell.inputs:
        extra["importance_sampling_ratio"] = step["importance_sampling_ratio"]

    def generated(self: Any, inputs: Any) -> dict[str, Any]:
        # TRL's generation and scoring, replayed: the step's batch with the cell's fields
        self._rewards_per_func = step["rewards_per_func"].clone()
        return {**{k: v for k, v in step["output"].items()}, **extra}

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", generated)
    trainer.model.train()
    trainer._generate_and_score_completions(step["inputs"])
    got = trainer.last_all_advantages

    output = step["output"]
    mask = output["completion_mask"].bool()
    computed = policy_forward(trainer, output)
    per_token: dict[str, np.ndarray] = {}
    for name in cell.inputs:
        if name == "logprobs" and cell.variant == "old_per_token_logps":
            per_token[name] = as_numpy(step["old_per_token_logps"])
        elif name == "is_weights":
            per_token[name] = as_numpy(step["importance_sampling_ratio"])
        elif name in computed:
            per_token[name] = as_numpy(computed[name])
    groups = np.arange(mask.shape[0]) // trainer.num_generations
    expected = reference(
        as_numpy(output["completion_ids"]),
        as_numpy(mask),
        as_numpy(step["rewards_per_func"].sum(1)),
        groups,
        estimator_of(cell),
        per_token,
        {c: as_numpy(v) for c, v in teachers.items()} if "teacher_logprobs" in cell.inputs else {},
    )
    label = f"trl/{transport}/{cell.id}"
    assert_close(got, expected, label)
    if cell.preset == "grpo":
        assert_close(got, step["trl_advantages"], f"{label} against TRL's own")


def test_the_matrix_covers_every_per_token_input() -> None:
    """Every input some preset reads is given in some cell of each trainer that has it."""
    from matrix_support import HAS

    for integration, has in HAS.items():
        given = {name for cell in cells(integration) for name in cell.inputs}
        read = {n for c in cells("plain") for n in c.inputs}
        assert given == read & has, (integration, sorted(read & has - given))
