"""The TRL integration: a real ``GRPOTrainer`` run (2 optimizer steps, CPU) of a tiny randomly
initialised causal LM with a tokenizer trained in memory, nothing downloaded, training on the
service's advantages over HTTP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("trl")
import torch
from advantage_client.integrations.trl import AdvantageGRPOTrainer
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig

TEXT = "the cat sat on a mat and the dog ran to it so we all saw one red ball"
WORDS = TEXT.split()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"])
    tokenizer.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def odd_words(completions: list[str], **kwargs: Any) -> list[float]:
    """1 for a completion with an odd number of 'the', else 0: some of each in a group."""
    return [float(c.split().count("the") % 2) for c in completions]


def run(tmp_path: Path, estimator: str, url: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    prompts = [" ".join(WORDS[i : i + 3]) for i in range(8)]
    args = GRPOConfig(
        output_dir=str(tmp_path / estimator),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        temperature=1.5,
    )
    seen: list[torch.Tensor] = []

    class Recording(AdvantageGRPOTrainer):  # type: ignore[misc]
        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            seen.append(inputs["advantages"].detach().clone())
            return super()._compute_loss(model, inputs)

    trainer = Recording(
        model=model,
        reward_funcs=odd_words,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        advantage_estimator=estimator,
        advantage_transport="http",
        advantage_url=url,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    return seen


@pytest.mark.integration
def test_grpo_trainer_trains_on_the_services_per_token_advantages(
    tmp_path: Path, service: Any
) -> None:
    before = service.requests(transport="http", estimator="grpo+ktae")
    ktae = run(tmp_path, "ktae", service.url)
    assert service.requests(transport="http", estimator="grpo+ktae") >= before + 2
    assert ktae and all(a.dim() == 2 for a in ktae)
    # KTAE: advantages differ between the tokens of one completion
    assert any(len(torch.unique(row[row != 0])) > 1 for a in ktae for row in a)

    before = service.requests(transport="http", estimator="grpo")
    grpo = run(tmp_path, "grpo", service.url)
    assert service.requests(transport="http", estimator="grpo") >= before + 2
    # GRPO: one value per completion
    assert all(len(torch.unique(row[row != 0])) <= 1 for a in grpo for row in a)
    assert any(bool((a != 0).any()) for a in grpo)
