"""TRL's GRPOTrainer on the service's advantages: a tiny model on the CPU, nothing downloaded.

The model is a 2-layer Llama with random weights built from a config, the tokenizer a word-level
one trained in memory on a 24-word vocabulary. The task: each prompt names two target words
("say red ball"); a completion's reward is the share of them it contains, and it passes when it
contains both. A few tokens decide the reward, which is what token-level credit (KTAE) is for.

    advantage-service serve &                     # HTTP on 8000
    python clients/examples/trl_tiny.py --url http://127.0.0.1:8000 --estimator ktae-history

Prints one JSON line per logging step (reward, pass rate, the service's call time and history
outcome) and exits 0. ``--estimator``: a preset (``grpo``, ``ktae``, ...), ``ktae-history``
(GRPO + KTAE with history per prompt) or ``trl`` (TRL's own advantages, no service).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    PrinterCallback,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer

SENTENCE = (
    "say the cat sat on a mat and dog ran to it so we all saw one red ball big box blue sun hat"
)
WORDS = SENTENCE.split()
TARGETS = ["red", "ball", "box", "blue", "sun", "hat", "cat", "dog"]
KTAE_HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS, trained in memory."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"])
    tokenizer.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden: int = 32) -> Any:
    """A 2-layer Llama with random weights (seeded)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def task_dataset(prompts: int) -> Dataset:
    """``prompts`` prompts "say <a> <b>", each with its two target words."""
    rows = [(TARGETS[i % 8], TARGETS[(3 * i + 1) % 8]) for i in range(prompts)]
    return Dataset.from_dict(
        {
            "prompt": [f"say {a} {b}" for a, b in rows],
            "targets": [[a, b] for a, b in rows],
        }
    )


def target_reward(completions: list[str], targets: list[list[str]], **kwargs: Any) -> list[float]:
    """The share of the prompt's target words the completion contains."""
    out = []
    for text, wanted in zip(completions, targets, strict=True):
        words = set(text.split())
        out.append(sum(w in words for w in wanted) / len(wanted))
    return out


def pass_rate_reward(
    completions: list[str], targets: list[list[str]], **kwargs: Any
) -> list[float]:
    """1 when every target word is in the completion (logged, weight 0: not trained on)."""
    return [
        float(all(w in set(c.split()) for w in t))
        for c, t in zip(completions, targets, strict=True)
    ]


def estimator_of(name: str) -> Any:
    return KTAE_HISTORY if name == "ktae-history" else name


class Steps(TrainerCallback):  # type: ignore[misc]
    """One record per logging step: the trainer's metrics, plus the pass rate."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "reward" in logs:
            self.records.append({"step": state.global_step, **logs})


def build(args: argparse.Namespace, output_dir: str, callbacks: list[Any]) -> Any:
    """The trainer: TRL's own (``--estimator trl``) or AdvantageGRPOTrainer over HTTP."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, args.seed)
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts_per_step * args.generations,
        num_generations=args.generations,
        max_completion_length=args.completion_length,
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        temperature=1.0,
        beta=0.0,
        reward_weights=[1.0, 0.0],
        disable_tqdm=True,
    )
    common: dict[str, Any] = {
        "model": model,
        # the pass rate is a second reward function of weight 0: logged, not trained on
        "reward_funcs": [target_reward, pass_rate_reward],
        "args": config,
        "train_dataset": task_dataset(args.prompts),
        "processing_class": tokenizer,
        "callbacks": callbacks,
    }
    if args.estimator == "trl":
        return GRPOTrainer(**common)
    from advantage_client.integrations.trl import AdvantageGRPOTrainer

    return AdvantageGRPOTrainer(
        **common,
        advantage_estimator=estimator_of(args.estimator),
        advantage_url=args.url,
        advantage_options={"namespace": args.namespace or f"trl-tiny-{time.time_ns()}"},
        # GTPO and the other entropy readers need the policy's entropies: one extra forward pass
        advantage_extra_forward=getattr(args, "extra_forward", False),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service's HTTP address")
    p.add_argument("--estimator", default="ktae-history")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts in the dataset")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--namespace", default=None, help="the service namespace (default: a new one)")
    p.add_argument("--output-dir", default="trl-tiny-out")
    p.add_argument(
        "--extra-forward",
        action="store_true",
        help="one extra forward pass per step for the entropies (GTPO, forking tokens, ...)",
    )
    return p


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train; one record per step: step, reward, pass rate, the service's metrics."""
    steps = Steps()
    trainer = build(args, args.output_dir, [steps])
    trainer.remove_callback(PrinterCallback)  # (this script prints its own lines)
    trainer.train()
    out = []
    for r in steps.records:
        row = {
            "step": r["step"],
            "reward": r["rewards/target_reward/mean"],
            "pass_rate": r["rewards/pass_rate_reward/mean"],
        }
        for key in ("advantage_service/call_ms", "advantage_service/history_applied"):
            if key in r:
                row[key.split("/", 1)[1]] = r[key]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    for record in run(args):
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())
