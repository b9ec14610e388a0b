"""A service restarted while a trainer's advantage call waits: the wait is logged (the client's
warnings, at once and every few seconds) and the call's retries reach the trainer's metrics:
TRL's logged metrics and verl's step metrics (``advantage_service/retries``)."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from restart_support import RestartingService

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
FAILED = re.compile(r"POST http://127\.0\.0\.1:\d+/v1/advantages failed \(.*\): (\d+) failed tries")
RECOVERED = re.compile(r"POST http://127\.0\.0\.1:\d+/v1/advantages succeeded after (\d+) retries")
DOWN_FOR = 3.0


def retry_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[int], list[int]]:
    """(the failed-tries count of each warning, the retries of each recovery line)."""
    messages = [r.getMessage() for r in caplog.records if r.name == "advantage_client.retry"]
    failed = [int(m[1]) for line in messages if (m := FAILED.match(line))]
    recovered = [int(m[1]) for line in messages if (m := RECOVERED.match(line))]
    return failed, recovered


@pytest.fixture
def restarting(tmp_path: Path) -> Iterator[RestartingService]:
    service = RestartingService(tmp_path)
    service.start()
    yield service
    service.close()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_trl_logs_the_wait_and_reports_the_retries(
    restarting: RestartingService, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("trl")
    import torch
    from advantage_client.integrations.trl import AdvantageGRPOTrainer
    from datasets import Dataset
    from trainer_support import tiny_grpo_config

    sys.path.insert(0, str(ROOT / "clients" / "examples"))
    from trl_tiny import tiny_model, tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog", "ran"]
    trainer = AdvantageGRPOTrainer(
        model=tiny_model(tokenizer, hidden=16),
        reward_funcs=lambda completions, **kw: [float(len(c) % 2) for c in completions],
        args=tiny_grpo_config(tmp_path, logging_steps=1),
        train_dataset=Dataset.from_dict({"prompt": [" ".join(words[i : i + 3]) for i in range(8)]}),
        processing_class=tokenizer,
        advantage_estimator="grpo",
        advantage_url=restarting.url,  # (the listing read now, while the service is up)
    )
    restarting.stop()
    restarting.start_after(DOWN_FOR)
    with caplog.at_level(logging.WARNING, logger="advantage_client.retry"):
        trainer.train()
    record = trainer.advantage_calls[-1]
    failed, recovered = retry_lines(caplog)
    assert failed and failed[0] == 1  # logged at the first failed attempt
    assert recovered == [record["retries"]] and record["retries"] >= failed[-1]
    assert record["ms"] >= DOWN_FOR * 1000 and record["fallback"] is False
    logged = next(h for h in trainer.state.log_history if "advantage_service/retries" in h)
    assert logged["advantage_service/retries"] == record["retries"]


def legacy_batch(seed: int) -> Any:
    """A batch as verl's legacy trainer holds it at its advantage step (what its
    compute_data_metrics reads included)."""
    import torch
    from verl import DataProto

    rng = np.random.default_rng(seed)
    b, p, t = 8, 3, 4
    scores = torch.zeros(b, t)
    scores[:, -1] = torch.from_numpy(rng.integers(0, 2, b).astype(np.float32))
    return DataProto.from_dict(
        tensors={
            "prompts": torch.from_numpy(rng.integers(2, 50, (b, p))),
            "responses": torch.from_numpy(rng.integers(2, 50, (b, t))),
            "attention_mask": torch.ones(b, p + t, dtype=torch.long),
            "response_mask": torch.ones(b, t, dtype=torch.long),
            "token_level_scores": scores,
            "token_level_rewards": scores.clone(),
        },
        non_tensors={"uid": np.array([f"u{i // 4}" for i in range(b)], dtype=object)},
    )


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_verl_logs_the_wait_and_returns_the_retries_in_its_step_metrics(
    restarting: RestartingService, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("verl.trainer.ppo.ray_trainer")
    from advantage_client.integrations import verl as adv_verl
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    adv_verl.register("http", restarting.url, presets=["grpo"])
    adv_verl.patch()
    try:
        fn = adv_verl.REGISTERED["adv_grpo"]
        # a step whose call needed no retry reports 0
        data = ray_trainer.compute_advantage(
            legacy_batch(1), adv_estimator="adv_grpo", config=AlgoConfig()
        )
        metrics = ray_trainer.compute_data_metrics(batch=data, use_critic=False)
        assert metrics["advantage_service/retries"] == 0
        assert metrics["advantage_service/fallback"] == 0
        assert "critic/advantages/mean" in metrics  # (verl's own metrics, still there)
        restarting.stop()
        restarting.start_after(DOWN_FOR)
        before = fn.retry_stats.retries
        with caplog.at_level(logging.WARNING, logger="advantage_client.retry"):
            data = ray_trainer.compute_advantage(
                legacy_batch(2), adv_estimator="adv_grpo", config=AlgoConfig()
            )
        metrics = ray_trainer.compute_data_metrics(batch=data, use_critic=False)
        # a later step without a call of ours reports nothing stale
        assert "advantage_service/retries" not in ray_trainer.compute_data_metrics(
            batch=data, use_critic=False
        )
    finally:
        adv_verl.unpatch()
    failed, recovered = retry_lines(caplog)
    retries = fn.retry_stats.retries - before
    assert failed and failed[0] == 1
    assert recovered == [retries] and retries >= failed[-1] >= 1
    assert metrics["advantage_service/retries"] == retries


def test_verl_v1_advantage_step_adds_the_calls_metrics() -> None:
    """The v1 trainer's advantage step (as patch() wraps it) puts the call's metrics in the
    step's ``metrics`` dict; here its body is the legacy compute_advantage of one batch."""
    pytest.importorskip("verl.trainer.ppo.ray_trainer")
    from types import SimpleNamespace

    from advantage_client.integrations import verl as adv_verl
    from advantage_client.integrations.verl.patching import _v1_step_with_call_metrics
    from omegaconf import OmegaConf
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    adv_verl.register(presets=["grpo"])
    adv_verl.patch()
    try:

        def body(self: Any, batch: Any, metrics: dict[str, Any]) -> Any:
            return ray_trainer.compute_advantage(
                batch, adv_estimator="adv_grpo", config=AlgoConfig()
            )

        trainer = SimpleNamespace(
            config=OmegaConf.create({"algorithm": {"adv_estimator": "adv_grpo"}})
        )
        metrics: dict[str, Any] = {"verl/own": 1.0}
        _v1_step_with_call_metrics(body)(trainer, legacy_batch(3), metrics)
    finally:
        adv_verl.unpatch()
    # (in-process: no client, no retries)
    assert metrics == {
        "verl/own": 1.0,
        "advantage_service/retries": 0.0,
        "advantage_service/fallback": 0.0,
    }
