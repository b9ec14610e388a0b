"""The OpenRLHF 0.11.2 test environment: the package ``--no-deps`` (its pins, flash-attn and
CUDA builds among them, do not install on a CPU machine) plus what importing its
``openrlhf.trainer.ppo_utils.experience_maker`` needs: ray, deepspeed (built without its ops),
transformers and peft (its ``openrlhf.models`` package), sympy and pylatexenc (its
``openrlhf.utils`` package), aiohttp (its agent executor), torch pinned to the CPU build, and the
service's runtime dependencies for the in-process transport. The GPU-only flash_attn and vllm
alone are stood in for, inside the step script (``openrlhf_step.py``)."""

from __future__ import annotations

from trainer_envs import EnvSpec, service_requirements

OPENRLHF_VERSION = "0.11.2"
OPENRLHF_ENV = EnvSpec(
    name="openrlhf",
    packages=(
        *service_requirements(),
        "ray==2.55.0",
        "aiohttp",
        "deepspeed==0.19.6",
        "transformers==5.15.0",
        "peft",
        "torchdata",
        "sympy",
        "pylatexenc",
        "tqdm",
    ),
    no_deps=(f"openrlhf=={OPENRLHF_VERSION}",),
)
