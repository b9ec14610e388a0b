"""One prompt key for every trainer integration (advantage_contract.prompt_keys): the same
prompt sent by TRL's and by verl's integration lands under one key in one namespace, so the
second trainer's call reads the history the first one stored; TRL's keys of client 0.1 stay
available for a run whose history started under them."""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("trl")
pytest.importorskip("verl.trainer.ppo.ray_trainer")
import torch
from advantage_client.integrations import verl as adv_verl
from advantage_client.integrations.trl import AdvantageGRPOTrainer
from datasets import Dataset
from trainer_support import tiny_grpo_config
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import ray_trainer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "examples"))
from trl_tiny import tiny_model, tiny_tokenizer  # noqa: E402

HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog", "ran", "to", "it"]


def blake(ids: list[int], size: int) -> str:
    """The hash of int64 little-endian token ids, written here from the definition."""
    return hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=size).hexdigest()


class Recording(AdvantageGRPOTrainer):  # type: ignore[misc]
    """Keeps each call's keyword arguments and result, and each batch's prompt ids."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[dict[str, Any]] = []
        self.results: list[Any] = []
        self.outputs: list[dict[str, Any]] = []
        inner = self._compute_padded

        def spy(*a: Any, **kw: Any) -> Any:
            self.sent.append(kw)
            self.results.append(inner(*a, **kw))
            return self.results[-1]

        self._compute_padded = spy

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        self.outputs.append(output)
        return output


def trl_run(tmp_path: Path, **advantage: Any) -> Recording:
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    trainer = Recording(
        model=tiny_model(tokenizer, hidden=16),
        reward_funcs=lambda completions, **kw: [float(len(c) % 2) for c in completions],
        args=tiny_grpo_config(tmp_path, temperature=1.5),
        train_dataset=Dataset.from_dict({"prompt": [" ".join(WORDS[i : i + 3]) for i in (0, 4)]}),
        processing_class=tokenizer,
        **advantage,
    )
    trainer.train()
    return trainer


def prompt_of(trainer: Recording, row: int) -> list[int]:
    output = trainer.outputs[0]
    return [int(i) for i in output["prompt_ids"][row][output["prompt_mask"][row].bool()]]


def verl_call(url: str, namespace: str, prompt: list[int]) -> tuple[str, str]:
    """One verl advantage step (the legacy trainer's compute_advantage, patched) of one group of
    four responses to ``prompt`` (left-padded as verl's batch holds it) under a fresh uid:
    (the key it sent, the history outcome the service answered)."""
    made = adv_verl.register("http", url, presets={"hist": HISTORY}, namespace=namespace)
    fn = made["adv_hist"]
    seen: dict[str, Any] = {}
    real = fn.compute_padded

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen["keys"] = kwargs["prompt_keys"]
        seen["result"] = real(*args, **kwargs)
        return seen["result"]

    fn.compute_padded = spy
    adv_verl.patch()
    try:
        width = len(prompt) + 2
        prompts = torch.tensor([[0] * (width - len(prompt)) + prompt] * 4)
        prompt_mask = (torch.arange(width) >= width - len(prompt)).long().expand(4, -1)
        responses = torch.tensor([[5, 6, 7], [6, 7, 8], [7, 8, 9], [8, 9, 5]])
        rewards = torch.zeros(4, 3)
        rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
        data = DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "response_mask": torch.ones(4, 3, dtype=torch.long),
                "attention_mask": torch.cat([prompt_mask, torch.ones(4, 3).long()], 1),
                "token_level_rewards": rewards,
            },
            non_tensors={"uid": np.array([str(uuid.uuid4())] * 4, dtype=object)},
        )
        ray_trainer.compute_advantage(data, adv_estimator="adv_hist", config=AlgoConfig())
    finally:
        adv_verl.unpatch()
    keys = set(seen["keys"])
    assert len(keys) == 1
    return keys.pop(), str(seen["result"].summary.get("history"))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_trl_and_verl_send_one_key_for_one_prompt_and_share_its_history(
    tmp_path: Path, service: Any
) -> None:
    namespace = f"one-key-{uuid.uuid4().hex[:8]}"
    trainer = trl_run(
        tmp_path,
        advantage_estimator=HISTORY,
        advantage_url=service.url,
        advantage_options={"namespace": namespace},
    )
    prompt = prompt_of(trainer, 0)
    trl_key = str(trainer.sent[0]["prompt_keys"][0])
    assert trl_key == "p:" + blake(prompt, 16)
    assert trainer.results[0].summary["history"] == "empty"  # (the first visit)
    verl_key, history = verl_call(service.url, namespace, prompt)
    assert verl_key == trl_key
    assert history == "applied"  # TRL's visit, read by verl's call under the one key
    # the control: the same call in another namespace finds nothing
    assert verl_call(service.url, namespace + "-other", prompt) == (trl_key, "empty")


def test_trl_keeps_its_keys_of_client_0_1_when_asked(tmp_path: Path) -> None:
    default = trl_run(tmp_path, advantage_estimator=HISTORY, advantage_transport="inprocess")
    legacy = trl_run(
        tmp_path,
        advantage_estimator=HISTORY,
        advantage_transport="inprocess",
        advantage_options={"prompt_key_scheme": "trl-0.1"},
    )
    for row in range(8):
        assert default.sent[0]["prompt_keys"][row] == "p:" + blake(prompt_of(default, row), 16)
        assert legacy.sent[0]["prompt_keys"][row] == blake(prompt_of(legacy, row), 12)
    with pytest.raises(ValueError, match="prompt_key_scheme must be one of"):
        trl_run(
            tmp_path,
            advantage_transport="inprocess",
            advantage_options={"prompt_key_scheme": "trl-0.2"},
        )
