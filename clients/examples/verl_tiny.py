"""A tiny verl run on the CPU against a running service: what can run without rollout servers.

verl 0.9's full PPO loop (either trainer) generates through vLLM/SGLang rollout servers, which
a CPU machine cannot start; this launcher runs the rest the way verl does. It starts Ray with
the package's setup hook (so the estimators are registered inside the actor, as in the
TaskRunner), builds a 2-layer random Qwen2 from a config and a word-level tokenizer in memory
(nothing downloaded), and for ``--steps`` steps: samples 4 responses per prompt with
``generate``, scores them (reward 1 when the response contains the prompt's target word),
computes advantages with verl's ``compute_advantage`` inside the actor (``adv_<estimator>``
through the service), and takes a policy-gradient step with them.

    advantage-service serve &        # or any running service
    python clients/examples/verl_tiny.py --url http://127.0.0.1:8000 --estimator ktae_history

``verl_tiny.yaml`` beside it holds the verl command line a GPU run uses with the same hook.
"""

from __future__ import annotations

import argparse
import os
import uuid

import numpy as np
import ray
import torch
from advantage_client.integrations import verl as adv_verl

WORDS = ["pad", "eos", "a", "b", "c", "d", "e", "f", "g", "h", "find", "x", "y", "z"]
PAD, EOS = 0, 1
TARGETS = [2, 3, 4, 5]  # prompt i asks for word TARGETS[i]
HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}


@ray.remote
class Trainer:
    """The TaskRunner's part: the model, sampling, the advantage step, the update."""

    def __init__(self, seed: int) -> None:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(seed)
        config = Qwen2Config(
            vocab_size=len(WORDS),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
        self.model = Qwen2ForCausalLM(config)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-3)

    def step(self, estimator: str, n: int = 4, length: int = 6) -> dict[str, float]:
        from verl import DataProto
        from verl.trainer.config import AlgoConfig
        from verl.trainer.ppo import ray_trainer

        prompts = torch.tensor([[10, t] for t in TARGETS]).repeat_interleave(n, 0)
        with torch.no_grad():
            out = self.model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                max_new_tokens=length,
                min_new_tokens=length,
                pad_token_id=PAD,
            )
        responses = out[:, prompts.shape[1] :]
        mask = torch.ones_like(responses)
        hit = (responses == prompts[:, 1:2]).any(1).float()
        rewards = torch.zeros(responses.shape)
        rewards[:, -1] = hit
        uids = np.repeat([str(uuid.uuid4()) for _ in TARGETS], n).astype(object)
        data = DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1),
                "responses": responses,
                "response_mask": mask,
                "token_level_rewards": rewards,
            },
            non_tensors={"uid": uids},
        )
        data = ray_trainer.compute_advantage(
            data, adv_estimator=estimator, config=AlgoConfig(adv_estimator=estimator)
        )
        advantages = data.batch["advantages"]
        logits = self.model(out, attention_mask=torch.ones_like(out)).logits
        logp = torch.log_softmax(logits[:, prompts.shape[1] - 1 : -1], -1)
        taken = logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        loss = -(advantages * taken * mask).sum() / mask.sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"reward": float(hit.mean()), "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--estimator", default="ktae_history")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env=adv_verl.runtime_env(
            "http",
            args.url,
            presets=["grpo", "ktae"],
            estimators={"ktae_history": HISTORY},
            ignore_token_ids=[PAD, EOS],
        ),
    )
    try:
        trainer = Trainer.remote(args.seed)
        for step in range(args.steps):
            stats = ray.get(trainer.step.remote(f"adv_{args.estimator}"))
            print(
                f"step {step}: reward {stats['reward']:.3f} loss {stats['loss']:+.4f}", flush=True
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
