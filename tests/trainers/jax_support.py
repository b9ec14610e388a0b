"""The JAX trainers' test environment: JAX on the CPU, Tunix, and the service's own
requirements (torch pinned to the CPU build) so that the in-process path runs there too."""

from __future__ import annotations

from trainer_envs import EnvSpec, service_requirements

JAX_VERSION = "0.10.2"
TUNIX_VERSION = "0.1.7"
JAX_ENV = EnvSpec(
    name="jax",
    packages=(
        f"jax[cpu]=={JAX_VERSION}",
        f"google-tunix=={TUNIX_VERSION}",
        *service_requirements(),
    ),
)
# Two host devices, for arrays sharded over a mesh as a multi-device trainer holds them.
TWO_CPU_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
