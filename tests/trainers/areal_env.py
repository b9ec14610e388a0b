"""The AReaL 1.0.4 test environment: the package ``--no-deps`` (it pins torch below 2.11 and
pulls agent frameworks its advantage step never imports) plus what importing
``areal.trainer.ppo.actor`` needs (the package's ``__init__`` imports its controllers,
schedulers, launchers and stats loggers), torch pinned to the CPU build, and the service's runtime
dependencies for the in-process transport. swanlab (a stats logger AReaL imports) goes in
``--no-deps`` too: it pins protobuf below 7, which the client's gRPC code needs; its protobuf
code imports under 7. Nothing is stood in for."""

from __future__ import annotations

from trainer_envs import EnvSpec, service_requirements

AREAL_VERSION = "1.0.4"
AREAL_ENV = EnvSpec(
    name="areal",
    packages=(
        *service_requirements(),
        "transformers==5.3.0",
        "peft<=0.18.1",
        "omegaconf==2.4.0.dev2",
        "hydra-core==1.4.0.dev1",
        "networkx==3.3",
        "ray",
        "datasets",
        "torchdata",
        "aiohttp",
        "aiofiles",
        "uvloop",
        "flask",
        "pyzmq",
        "orjson",
        "msgspec",
        "tabulate",
        "colorlog",
        "colorama",
        "tenacity",
        "nvidia-ml-py",
        "pybase64",
        "setproctitle",
        "einops",
        "lark",
        "numba",
        "pillow",
        "openai",
        # swanlab's own dependencies (it goes in --no-deps: it pins protobuf below 7, the
        # client needs 7)
        "click",
        "platformdirs",
        "psutil",
        "pwinput",
        "pydantic-settings",
        "pyecharts",
        "pyroaring<1.0.4",
        "pyyaml",
        "requests",
        "rich",
        "watchdog",
        "wrapt",
        "trackio==0.43.0",
        "wandb==0.31.0",
        "tensorboardX",
        "redis",
        "prettytable",
        "python-dotenv",
    ),
    no_deps=(f"areal=={AREAL_VERSION}", "swanlab==0.10.3"),
)
