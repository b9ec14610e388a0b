"""TRL's ``multi_objective_aggregation="normalize_then_sum"`` through the TRL integration: a real
``GRPOTrainer`` step (CPU, a tiny randomly initialised Llama, nothing downloaded) with two reward
functions, one of them None on some rows, trained on the service's ``gdpo`` advantages equal to
TRL's own; and the settings it refuses at construction."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("trl")
import numpy as np
import torch
from advantage_client.integrations.trl import AdvantageGRPOTrainer
from datasets import Dataset
from trainer_support import tiny_grpo_config
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "examples"))
from trl_tiny import tiny_model, tiny_tokenizer  # noqa: E402

PROMPTS = ["the cat sat", "on a mat", "and the dog", "ran to it"]


def cycling(name: str, values: list[float | None]) -> Callable[..., list[float | None]]:
    """A reward function named ``name`` giving each group's rows ``values`` in order (groups are
    consecutive rows of num_generations)."""

    def reward(completions: list[str], **kwargs: Any) -> list[float | None]:
        return [values[i % len(values)] for i in range(len(completions))]

    reward.__name__ = name
    return reward


# accuracy: 0/1; brevity: wide values, None on some rows (an unscored row of every function in
# the first group's first row)
ACCURACY = cycling("accuracy", [None, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
BREVITY = cycling("brevity", [None, 30.0, None, 5.0, 12.0, 12.0, 40.0, 0.0])


def config(tmp_path: Path, **overrides: Any) -> GRPOConfig:
    settings: dict[str, Any] = {
        "max_completion_length": 6,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "seed": 0,
        "multi_objective_aggregation": "normalize_then_sum",
        "reward_weights": [1.0, 0.5],
    }
    return tiny_grpo_config(tmp_path, **{**settings, **overrides})


class Keeping:
    """Keeps the advantages the trainer trained on, and the completion mask."""

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        self.advantages = output["advantages"].detach().clone()  # type: ignore[attr-defined]
        self.mask = output["completion_mask"].detach().clone()  # type: ignore[attr-defined]
        return output


class TrlOwn(Keeping, GRPOTrainer):  # type: ignore[misc]
    pass


class Ours(Keeping, AdvantageGRPOTrainer):  # type: ignore[misc]
    pass


def trainer_of(tmp_path: Path, cls: type, **advantage: Any) -> Any:
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    return cls(
        model=tiny_model(tokenizer, hidden=16),
        reward_funcs=[ACCURACY, BREVITY],
        args=config(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        **advantage,
    )


def test_normalize_then_sum_is_trls_own_on_a_real_step(tmp_path: Path) -> None:
    own = trainer_of(tmp_path, TrlOwn)
    own.train()
    ours = trainer_of(tmp_path, Ours, advantage_estimator="gdpo", advantage_transport="inprocess")
    ours.train()
    assert ours.advantage_estimator["outcome"] == {
        "name": "gdpo",
        "weights": {"accuracy": 1.0, "brevity": 0.5},
        "normalization": "trl",
    }
    expected = own.advantages.double().numpy()  # (B,): TRL's one value per completion
    assert expected.shape == (8,) and expected[0] == 0.0
    got = ours.advantages.double().numpy()
    mask = ours.mask.bool().numpy()
    rows = np.array([np.unique(row[m]) for row, m in zip(got, mask, strict=True)], dtype=object)
    assert all(r.size == 1 for r in rows)  # an outcome-only estimator: one value per row
    values = np.array([float(r[0]) for r in rows])
    assert np.abs(values - expected).max() <= 1e-5 * np.abs(expected).max(), (values, expected)
    # TRL's default aggregation (the weighted sum, then GRPO) gives other advantages
    summed = np.array([np.nan, 16, 0, 3.5, 6, 6, 21, 1])
    assert not np.allclose(values[1:4], (summed[1:4] - 6.5) / summed[1:4].std(ddof=1), atol=1e-2)


@pytest.mark.parametrize(
    ("options", "estimator", "says"),
    [
        ({}, "grpo", "only the gdpo outcome"),
        ({"multi_objective_aggregation": "sum_then_normalize"}, "gdpo", "normalize_then_sum"),
        ({}, {"outcome": {"name": "gdpo", "normalization": "verl"}}, "normalization='verl'"),
    ],
)
def test_settings_it_cannot_honour_are_refused_before_the_model_loads(
    tmp_path: Path, options: dict[str, Any], estimator: Any, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        AdvantageGRPOTrainer(
            model="no/such-model",
            reward_funcs=[ACCURACY, BREVITY],
            args=config(tmp_path, **options),
            advantage_estimator=estimator,
            advantage_transport="inprocess",
        )


@pytest.mark.parametrize(
    ("funcs", "estimator", "says"),
    [
        ([ACCURACY, cycling("accuracy", [1.0])], "gdpo", "distinct __name__s"),
        (
            [ACCURACY, BREVITY],
            {"outcome": {"name": "gdpo", "weights": {"accuracy": 2.0}}},
            "not TRL's reward_weights",
        ),
    ],
)
def test_reward_functions_it_cannot_send_are_refused_at_construction(
    tmp_path: Path, funcs: list[Any], estimator: Any, says: str
) -> None:
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match=says):
        AdvantageGRPOTrainer(
            model=tiny_model(tokenizer, hidden=16),
            reward_funcs=funcs,
            args=config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=tokenizer,
            advantage_estimator=estimator,
            advantage_transport="inprocess",
        )
