"""Run in the JAX environment by test_tunix_integration.py: Tunix's GRPO on the CPU (its toy
transformer built from a config with random weights, the vanilla rollout, 2 prompts x 4
generations, 2 steps, the same prompts on both) through ``AdvantageGRPOLearner`` with the
service's KTAE (history per prompt), over HTTP and over gRPC; ``adv_grpo`` through ``register``
beside Tunix's own ``grpo``; a preset needing entropy built into a learner. Writes an .npz,
each transport's answers under ``<transport>/``.

usage: tunix_script.py URL TARGET NAMESPACE OUT.npz
"""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx
import jax
import numpy as np
import optax
from advantage_client.integrations import tunix as adv_tunix
from flax import nnx
from grain import python as grain
from jax.interpreters import pxla
from tunix.rl import (
    algo_core,  # noqa: F401  (registers Tunix's own estimators)
    function_registry,
)
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo.grpo_learner import GRPOConfig
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

PROMPTS = ["hello world", "input string"]
GENERATIONS = 4
KTAE = {"outcome": "grpo", "ktae": {"history": "prompt"}}


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    # (a reward that differs between completions: their letters, modulo 5)
    return [float(sum(len(w) for w in c.split()) % 5) for c in completions]


def cluster() -> rl_cluster_lib.RLCluster:
    vocab = tc.MockVocab()
    config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
    actor = tc.ToyTransformer(config=config, rngs=nnx.Rngs(0))
    mesh = pxla.thread_resources.env.physical_mesh
    roles = rl_cluster_lib.Role
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=100, max_steps=2
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=6, max_prompt_length=8, kv_cache_size=64, temperature=1.0
        ),
    )
    return rl_cluster_lib.RLCluster(
        actor=actor, reference=None, tokenizer=vocab, cluster_config=config
    )


def main(url: str, target: str, namespace: str, out_path: str) -> None:
    out: dict[str, Any] = {}
    for transport, where in (("http", url), ("grpc", target)):
        run(transport, where, f"{namespace}-{transport}", out, f"{transport}/", url)
    print(f"on {jax.devices()}")
    np.savez(out_path, **out)


def counted(stats_url: str, namespace: str) -> int:
    response = httpx.get(f"{stats_url}/v1/stats/tokens", params={"namespace": namespace})
    return int(response.json()["rollouts_counted"]) if response.status_code == 200 else -1


def written(stats_url: str, namespace: str, rollouts: int) -> None:
    """Wait until a step's statistics (written after the answer) are stored: the next step
    then reads them whatever the machine's load."""
    deadline = time.monotonic() + 60
    while counted(stats_url, namespace) < rollouts:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the service never stored {rollouts} rollouts of {namespace}")
        time.sleep(0.05)


def run(
    transport: str, url: str, namespace: str, out: dict[str, Any], at: str, stats_url: str
) -> None:
    made = adv_tunix.register(
        transport,
        url,
        presets={"grpo": "grpo", "ktae": KTAE, "forking": "forking"},
        namespace=namespace,
    )
    # adv_grpo through the registry beside Tunix's own grpo, on the same rewards.
    rewards = np.random.default_rng(0).integers(0, 3, 16).astype(np.float32)
    for name in ("adv_grpo", "grpo"):
        fn = function_registry.get_advantage_estimator(name)
        out[f"{at}registry/{name}"] = np.asarray(fn(rewards=rewards, num_generations=GENERATIONS))
    out[f"{at}registry/rewards"] = rewards

    try:
        adv_tunix.AdvantageGRPOLearner(
            rl_cluster=None,  # (refused before the cluster is looked at)
            algo_config=GRPOConfig(advantage_estimator="adv_forking", num_generations=2),
            reward_fns=reward,
        )
        out[f"{at}refused"] = np.array("")
    except adv_tunix.TunixConfigError as exc:
        out[f"{at}refused"] = np.array(str(exc))

    # The service's calls, seen from the estimator (what it sent and what came back).
    ktae = made["adv_ktae"]
    calls: list[tuple[dict[str, Any], Any]] = []
    real = ktae.compute_padded

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        calls.append(({"args": args, **kwargs}, result))
        written(stats_url, namespace, sum(len(sent["args"][2]) for sent, _ in calls))
        return result

    ktae.compute_padded = spy
    learner = adv_tunix.AdvantageGRPOLearner(
        rl_cluster=cluster(),
        algo_config=GRPOConfig(
            advantage_estimator="adv_ktae", num_generations=GENERATIONS, beta=0.0
        ),
        reward_fns=reward,
    )
    examples: list[Any] = []
    step = learner._generate_and_compute_advantage

    def seen(*args: Any, **kwargs: Any) -> Any:
        example = step(*args, **kwargs)
        examples.append(example)
        return example

    learner._generate_and_compute_advantage = seen
    source = PROMPTS * 2  # (the same prompts on both steps)
    dataset = grain.MapDataset.source(source).batch(len(PROMPTS)).map(lambda x: {"prompts": x})
    learner.train(dataset)
    out[f"{at}steps"] = np.array(len(examples))
    out[f"{at}calls"] = np.array(len(calls))
    for i, (example, (sent, result)) in enumerate(zip(examples, calls, strict=False)):
        ids, mask, sent_rewards, groups = sent["args"]
        out[f"{at}step{i}/advantages"] = np.asarray(example.advantages)
        out[f"{at}step{i}/sharding_ok"] = np.array(
            example.advantages.sharding == example.completion_ids.sharding
        )
        out[f"{at}step{i}/ids"] = np.asarray(ids)
        out[f"{at}step{i}/mask"] = np.asarray(mask)
        out[f"{at}step{i}/rewards"] = np.asarray(sent_rewards)
        out[f"{at}step{i}/groups"] = np.asarray(groups)
        out[f"{at}step{i}/prompt_keys"] = np.asarray(sent["prompt_keys"]).astype(str)
        out[f"{at}step{i}/history"] = np.array(str(result.summary.get("history")))


if __name__ == "__main__":
    main(*sys.argv[1:])
