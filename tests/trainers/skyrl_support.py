"""SkyRL's test environment: skyrl-train installed ``--no-deps --ignore-requires-python`` (its
wheel declares Python 3.12 only, its code runs on 3.11, and the CPU torch wheel here is for
3.11), with what its advantage step (``RayPPOTrainer.compute_advantages_and_returns`` and
``skyrl_train.utils.ppo_utils``) imports, and the service's own requirements (torch pinned to
the CPU build) for the in-process path."""

from __future__ import annotations

from trainer_envs import EnvSpec, service_requirements

SKYRL_VERSION = "0.3.1"
SKYRL_ENV = EnvSpec(
    name="skyrl",
    packages=(
        # ppo_utils and the skyrl_train.utils package it lives in import these at module level
        "ray==2.51.1",
        "jaxtyping",
        "loguru",
        "omegaconf",
        "fsspec",
        "cloudpickle",
        # what importing skyrl_train.trainer (RayPPOTrainer, whose advantage step the test runs)
        # adds; nothing of it runs on a GPU
        "tqdm",
        "transformers",
        "datasets==4.0.0",
        "skyrl-gym==0.4.0",
        "torchdata==0.11.0",
        *service_requirements(),
    ),
    no_deps=(f"skyrl-train=={SKYRL_VERSION}",),
    pip_flags=("--ignore-requires-python",),
)
