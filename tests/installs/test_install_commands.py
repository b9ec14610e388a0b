"""Every install command of the README and docs/, run as written in a clean virtual environment,
then its example: the client alone, ``[trl]``, ``[verl]``, ``[trl]`` then ``[verl]`` (the two doc
sections one after the other), both in one command, and the service for the in-process
transport. The environments are cached (tests/installs/install_envs.py): a first run builds
them (minutes each), a rerun costs the examples only."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from install_envs import TORCH_CPU, InstallEnv, ensure_install_env
from service_support import Service
from trainer_envs import ROOT, package_version, run_in_env

CLIENT = "pip install -e clients/python"
TRL = "pip install -e 'clients/python[trl]'"
VERL = "pip install -e 'clients/python[verl]'"
BOTH = "pip install -e 'clients/python[trl,verl]'"
SERVICE = "pip install -e ."
TUNIX = "pip install -e 'clients/python[tunix]'"

ENVS = {
    "client": InstallEnv("client", (CLIENT,)),
    "trl": InstallEnv("trl", (TORCH_CPU, TRL)),
    "verl": InstallEnv("verl", (TORCH_CPU, VERL)),
    "trl-then-verl": InstallEnv("trl-then-verl", (TORCH_CPU, TRL, VERL)),
    "trl-verl": InstallEnv("trl-verl", (TORCH_CPU, BOTH)),
    "service": InstallEnv("service", (TORCH_CPU, CLIENT, SERVICE)),
    "tunix": InstallEnv("tunix", (TUNIX,)),
}
# Documented commands that are not a user's install (with why).
NOT_RUN = {
    "pip install .": "the Docker image's build step (Dockerfile, described in docs/deploy.md)",
}
DOCUMENTS = (ROOT / "README.md", ROOT / "clients/python/README.md", *sorted(ROOT.glob("docs/*.md")))
COMMAND = re.compile(r"pip install [^`\n#]*[^`\n#\s]")
EXAMPLES = ROOT / "clients" / "examples"


def documented_commands() -> dict[str, list[str]]:
    """Each ``pip install`` command written in the README and docs/, with where."""
    found: dict[str, list[str]] = {}
    for path in DOCUMENTS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for command in COMMAND.findall(line):
                found.setdefault(command.strip(), []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


def test_every_documented_install_command_is_run_by_a_test() -> None:
    documented = documented_commands()
    run = {step for env in ENVS.values() for step in env.steps}
    untested = {c: where for c, where in documented.items() if c not in run | set(NOT_RUN)}
    assert not untested, f"install commands in the docs that no test runs: {untested}"
    # and every command run here is one the docs give
    assert run <= set(documented), sorted(run - set(documented))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    srv = Service.start(tmp_path_factory.mktemp("install-service"))
    yield srv
    srv.stop()


CLIENT_EXAMPLE = """
import json, sys
import numpy as np
from advantage_client import HttpClient
result = HttpClient(sys.argv[1]).compute_padded(
    None, np.ones((4, 3), bool), np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 1, 1])
)
print(json.dumps(result.advantages[:, 0].tolist()))
"""

INPROCESS_EXAMPLE = """
import json
import numpy as np
from advantage_contract.backend import inprocess
result = inprocess().compute_padded(
    None, np.ones((4, 3), bool), np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 1, 1])
)
print(json.dumps(np.asarray(result.advantages)[:, 0].tolist()))
"""


# What verl's Ray workers run at start (the setup hook, settings from ADVANTAGE_VERL_*), then a
# model built as verl's workers build one and an advantage step through the service, in one
# process (the Ray session itself runs once, in the one-command environment: verl_tiny.py).
VERL_HOOK_EXAMPLE = """
import json
import numpy as np, torch
from advantage_client.integrations import verl as adv_verl
adv_verl.setup()
assert "adv_grpo" in adv_verl.REGISTERED, sorted(adv_verl.REGISTERED)
import verl.trainer.main_ppo
from transformers import Qwen2Config, Qwen2ForCausalLM
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
model(torch.ones(1, 4, dtype=torch.long))
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import ray_trainer
rewards = torch.zeros(4, 3)
rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
data = DataProto.from_dict(
    tensors={"response_mask": torch.ones(4, 3, dtype=torch.long), "token_level_rewards": rewards},
    non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
)
out = ray_trainer.compute_advantage(data, adv_estimator="adv_grpo", config=AlgoConfig())
print(json.dumps(out.batch["advantages"][:, 0].tolist()))
"""


# The Tunix section's registration, then Tunix's own registry call of adv_grpo over HTTP, as
# its GRPOLearner makes it (rewards (B,), num_generations), beside Tunix's own grpo.
TUNIX_EXAMPLE = """
import json, sys
import jax.numpy as jnp
from tunix.rl import function_registry
from advantage_client.integrations import tunix as adv_tunix
adv_tunix.register("http", sys.argv[1], presets=["grpo"])
rewards = jnp.array([1.0, 0.0, 1.0, 0.0])
ours = function_registry.get_advantage_estimator("adv_grpo")(rewards=rewards, num_generations=2)
theirs = function_registry.get_advantage_estimator("grpo")(rewards=rewards, num_generations=2)
assert abs(jnp.asarray(ours) - jnp.asarray(theirs)).max() < 1e-5, (ours, theirs)
print(json.dumps([float(v) for v in jnp.asarray(ours)]))
"""


# What the install commands resolve to (each environment asserts those of the packages it has).
VERSIONS = {"advantage-client": "0.1.0", "torch": "2.13.0+cpu", "trl": "1.16.0", "verl": "0.9.1"}


def install_test(test: Callable[..., None]) -> Callable[..., None]:
    """An install test: selected with ``-m installs``, and given the time a first run takes to
    build its environment."""
    return pytest.mark.integration(pytest.mark.installs(pytest.mark.timeout(1800)(test)))


def installed(env: str, *packages: str) -> Path:
    """The python of environment ``env`` (built by its commands), each of ``packages`` in it at
    its version of :data:`VERSIONS`."""
    python = ensure_install_env(ENVS[env])
    for package in packages:
        assert package_version(python, package) == VERSIONS[package], package
    return python


def grpo_column(stdout: str) -> list[float]:
    return [round(v, 3) for v in json.loads(stdout.strip().splitlines()[-1])]


def trl_example(python: Path, url: str, tmp_path: Path) -> None:
    """clients/examples/trl_tiny.py (the TRL section's runnable example), one step."""
    done = run_in_env(
        python,
        EXAMPLES / "trl_tiny.py",
        *("--url", url, "--steps", "1", "--prompts-per-step", "2", "--generations", "4"),
        *("--output-dir", str(tmp_path / "trl-out")),
        timeout=300,
    )
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert [x["step"] for x in lines] == [1] and 0 <= lines[0]["reward"] <= 1


def verl_hook_example(python: Path, url: str) -> None:
    """The setup hook as verl's workers run it (over HTTP), a model, an advantage step."""
    settings = {"ADVANTAGE_VERL_TRANSPORT": "http", "ADVANTAGE_VERL_URL": url}
    done = run_in_env(python, VERL_HOOK_EXAMPLE, extra_env=settings, timeout=300)
    assert grpo_column(done.stdout) == [0.707, -0.707, 0.707, -0.707]


def verl_ray_example(python: Path, url: str) -> None:
    """clients/examples/verl_tiny.py (the verl section's runnable example), one step: Ray
    started with the setup hook, the estimators registered in the actor, a Qwen2 model built
    there, its advantages through the service."""
    done = run_in_env(python, EXAMPLES / "verl_tiny.py", "--url", url, "--steps", "1", timeout=400)
    assert re.search(r"^step 0: reward [\d.]+ loss [-+][\d.]+$", done.stdout, re.M), done.stdout


@install_test
def test_the_client_install_then_its_example(service: Service) -> None:
    python = installed("client", "advantage-client")
    done = run_in_env(python, CLIENT_EXAMPLE, service.url)
    assert grpo_column(done.stdout) == [0.707, -0.707, 0.707, -0.707]


@install_test
def test_the_service_install_then_the_inprocess_example() -> None:
    python = installed("service", "torch")
    done = run_in_env(python, INPROCESS_EXAMPLE, service=True)
    assert grpo_column(done.stdout) == [0.707, -0.707, 0.707, -0.707]


@install_test
def test_the_trl_install_then_the_trl_example(service: Service, tmp_path: Path) -> None:
    python = installed("trl", "trl", "torch")
    trl_example(python, service.url, tmp_path)


@install_test
def test_the_verl_install_then_the_verl_setup_hook(service: Service) -> None:
    python = installed("verl", "verl", "torch")
    verl_hook_example(python, service.url)


@install_test
def test_trl_then_verl_as_the_two_sections_say_keeps_both_working(
    service: Service, tmp_path: Path
) -> None:
    python = installed("trl-then-verl", "trl", "verl")
    verl_hook_example(python, service.url)  # (builds a model: what "[trl] then [verl]" broke)
    trl_example(python, service.url, tmp_path)


@install_test
def test_trl_and_verl_in_one_command_then_both_examples(service: Service, tmp_path: Path) -> None:
    """The command the docs give for both, then verl's Ray example and TRL's, as written."""
    python = installed("trl-verl", "trl", "verl", "torch")
    verl_ray_example(python, service.url)
    trl_example(python, service.url, tmp_path)


@install_test
def test_the_tunix_install_then_its_registry_example(service: Service) -> None:
    python = installed("tunix")
    assert package_version(python, "google-tunix").startswith("0.1.")
    done = run_in_env(python, TUNIX_EXAMPLE, service.url, timeout=300)
    first, second, third, fourth = grpo_column(done.stdout)  # (equal to Tunix's own: above)
    assert first > 0 > second and (first, second) == (third, fourth) and first == -second
