"""A whole TRL training step of the tiny model (clients/examples/trl_tiny.py) with the service's
GRPO against TRL's own GRPO, on the CPU.

    python bench/bench_trl_step.py [--steps 12] [--rounds 3] [--prompts-per-step 4]
        [--generations 8] [--completion-length 16] [--hidden 32]

Each round trains one fresh trainer per variant for ``--steps`` optimizer steps (the same seed,
model and data) and times each step from ``on_step_begin`` to ``on_step_end`` (generation,
rewards, advantages, the forward and backward passes, the optimizer); the first two steps of a
run are warm-up and not counted. The learning rate is 0, so every variant generates the same
completions and the steps differ only by how the advantages are computed. Variants, interleaved
in every round:

- ``trl``: ``GRPOTrainer`` with its own advantages (the reference);
- ``service-inprocess``: ``AdvantageGRPOTrainer``, GRPO computed in this process;
- ``service-http``: the same over HTTP (Arrow) to a server on this machine;
- ``extra-forward``: over HTTP with ``advantage_extra_forward=True`` (OTB + forking tokens:
  log-probs, entropies and sum_pi_squared from one more forward pass).

Prints each variant's median step and its ratio to TRL's (goal for GRPO: at most 1.05x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "examples"))

import torch
import trl_tiny
from advantage_client.integrations.trl import AdvantageGRPOTrainer
from service_process import ServiceProcess
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

WARMUP = 2


class Timer(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.began = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.began = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self.began)


def run(variant: str, args: argparse.Namespace, url: str, out: str) -> list[float]:
    tokenizer = trl_tiny.tiny_tokenizer()
    model = trl_tiny.tiny_model(tokenizer, args.seed, hidden=args.hidden)
    timer = Timer()
    common: dict[str, Any] = {
        "model": model,
        "reward_funcs": trl_tiny.target_reward,
        "args": GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts_per_step * args.generations,
            num_generations=args.generations,
            max_completion_length=args.completion_length,
            max_steps=args.steps,
            # (no update: every variant samples the same completions, so the steps differ only
            # by the advantage computation, not by what a differently trained policy generates)
            learning_rate=0.0,
            logging_steps=1000,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=args.seed,
            beta=0.0,
            disable_tqdm=True,
        ),
        "train_dataset": trl_tiny.task_dataset(16),
        "processing_class": tokenizer,
        "callbacks": [timer],
    }
    trainer: Any
    if variant == "trl":
        trainer = GRPOTrainer(**common)
    elif variant == "service-inprocess":
        trainer = AdvantageGRPOTrainer(**common, advantage_transport="inprocess")
    elif variant == "service-http":
        trainer = AdvantageGRPOTrainer(**common, advantage_url=url)
    else:
        trainer = AdvantageGRPOTrainer(
            **common,
            advantage_url=url,
            advantage_estimator={"outcome": "otb", "forking": {}},
            advantage_extra_forward=True,
        )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return timer.seconds[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    variants = ["trl", "service-inprocess", "service-http", "extra-forward"]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    with TemporaryDirectory() as tmp:
        server = ServiceProcess(log=Path(tmp) / "service.log")
        try:
            for r in range(args.rounds):
                for v in variants:
                    seconds[v] += run(v, args, server.url, f"{tmp}/{v}-{r}")
        finally:
            server.stop()
    base = statistics.median(seconds["trl"])
    rows = args.prompts_per_step * args.generations
    print(
        f"tiny Llama (hidden {args.hidden}, 2 layers), {rows} completions of <= "
        f"{args.completion_length} tokens per step, {args.rounds} rounds x "
        f"{args.steps - WARMUP} timed steps"
    )
    best = min(seconds["trl"])
    for v in variants:
        med, low = statistics.median(seconds[v]), min(seconds[v])
        print(
            f"{v:18s} median {med * 1000:7.1f} ms ({med / base:5.3f}x TRL's), "
            f"best {low * 1000:7.1f} ms ({low / best:5.3f}x)"
        )


if __name__ == "__main__":
    main()
