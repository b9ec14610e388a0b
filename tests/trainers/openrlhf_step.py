"""Runs in the OpenRLHF environment (``openrlhf_env.py``): OpenRLHF's own
``RemoteExperienceMaker.compute_advantages_and_returns`` on a synthetic batch of experiences,
once as OpenRLHF ships it and once patched by ``advantage_client.integrations.openrlhf`` (through
its Ray setup hook, settings from ``ADVANTAGE_OPENRLHF_*``), for each case.

argv[1]: a JSON object: ``transports`` (``[name, url or null]`` each) and ``cases``
(``[service estimator, OpenRLHF's estimator of the same math or null]`` each). Prints one JSON
object: OpenRLHF's version, what construction said to bad settings, and per transport the
batch as the service saw it and per case the advantages on the action tokens (per sample
index), the adapter's and, where named, OpenRLHF's own.
"""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.metadata
import json
import os
import sys
import types
from types import SimpleNamespace
from typing import Any


def stand_in_gpu_imports() -> None:
    """Two GPU-only packages lie on the import path of OpenRLHF's experience maker: flash_attn (a
    CUDA build), imported by ``openrlhf.models.ring_attn_utils`` for sequence-parallel helpers,
    and vllm (the GPU inference engine), imported by ``openrlhf.trainer.ray.vllm_engine``. The
    advantage step calls neither: these stand-ins provide the names imported, and nothing of
    OpenRLHF is replaced."""

    def unused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("flash_attn stand-in: not available in this test environment")

    for name, attrs in (
        ("flash_attn", {}),
        (
            "flash_attn.bert_padding",
            {n: unused for n in ("index_first_axis", "pad_input", "rearrange", "unpad_input")},
        ),
        ("flash_attn.utils", {}),
        ("flash_attn.utils.distributed", {"all_gather": unused}),
        ("vllm", {"__version__": "0.0.0"}),
        ("vllm.inputs", {"TokensPrompt": unused}),
        ("vllm.utils", {"random_uuid": unused}),
    ):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(attrs)
        sys.modules[name] = module


stand_in_gpu_imports()

import torch  # noqa: E402
from advantage_client.integrations import openrlhf as adv_openrlhf  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController  # noqa: E402
from step_support import construction_said, print_result  # noqa: E402

N_SAMPLES = 4
PROMPTS = 3
KL_COEF = 0.05
CLIP = (-10.0, 10.0)
PROMPT_IDS: list[list[int]] = []  # (each prompt's token ids, as made)


def make_args(estimator: str) -> SimpleNamespace:
    return SimpleNamespace(
        algo=SimpleNamespace(
            advantage=SimpleNamespace(estimator=estimator, gamma=1.0, no_std_norm=False)
        ),
        rollout=SimpleNamespace(n_samples_per_prompt=N_SAMPLES, max_new_tokens=8),
        reward=SimpleNamespace(
            clip_range=CLIP,
            overlong_buffer_len=3,
            overlong_penalty_factor=0.5,
            stop_properly_penalty_coef=0.5,
        ),
        data=SimpleNamespace(max_len=64),
    )


def make_experiences() -> list[Any]:
    """PROMPTS prompts x N_SAMPLES samples in 3 micro-batches of shuffled indices, right
    padded; one sample of two turns (an observation between its actions), one group of equal
    rewards, some samples past the overlong buffer and one truncated."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 40, (int(n),), generator=g) for n in (3, 5, 4)]
    PROMPT_IDS[:] = [p.tolist() for p in prompts]
    order = torch.randperm(PROMPTS * N_SAMPLES, generator=g).tolist()
    samples = []
    for i in order:
        prompt = prompts[i // N_SAMPLES]
        length = 2 + (i * 5) % 8  # 2..9 response tokens
        response = torch.randint(3, 40, (length,), generator=g)
        sequence = torch.cat([prompt, response])
        action = torch.zeros(len(sequence) - 1, dtype=torch.bool)
        action[len(prompt) - 1 :] = True
        if i == 5 and length > 4:  # an observation (tool output) inside the response
            action[len(prompt) + 1 : len(prompt) + 3] = False
        reward = 1.0 if i // N_SAMPLES == 2 else float((i * 7) % 3 == 0) + 0.25 * (i % 2)
        samples.append((i, sequence, action, reward, length))
    experiences = []
    for start in range(0, len(samples), 4):
        part = samples[start : start + 4]
        width = max(len(s[1]) for s in part)
        sequences = torch.zeros(len(part), width, dtype=torch.long)
        attention = torch.zeros(len(part), width, dtype=torch.long)
        actions = torch.zeros(len(part), width - 1, dtype=torch.bool)
        for row, (_, sequence, action, _, _) in enumerate(part):
            sequences[row, : len(sequence)] = sequence
            attention[row, : len(sequence)] = 1
            actions[row, : len(action)] = action
        kl = torch.rand(len(part), width - 1, generator=g) * 0.2 * actions
        logprobs = -torch.rand(len(part), width - 1, generator=g) * actions
        experiences.append(
            Experience(
                sequences=sequences,
                attention_mask=attention,
                action_mask=actions,
                action_log_probs=logprobs,
                kl=kl,
                rewards=torch.tensor([s[3] for s in part]),
                response_length=torch.tensor([s[4] for s in part]),
                truncated=torch.tensor([s[0] == 6 for s in part]),
                index=[s[0] for s in part],
                info={},
            )
        )
    return experiences


def maker(estimator: str) -> Any:
    args = make_args(estimator)
    return RemoteExperienceMaker(
        None, None, None, None, FixedKLController(KL_COEF), SimpleNamespace(args=args), None
    )


def by_index(experiences: list[Any], values: str) -> dict[int, list[float]]:
    """Per sample index, a (rows, actions) tensor field's values on the sample's actions."""
    out = {}
    for e in experiences:
        tensor = getattr(e, values)
        for row, index in enumerate(e.index):
            out[index] = tensor[row][e.action_mask[row]].double().tolist()
    return out


def run_cases(cases: list[Any]) -> dict[str, Any]:
    """Each case on a fresh copy of the batch: OpenRLHF's own estimator (where named), then the
    patched maker (patched by the setup hook, as Ray runs it in the trainer actor)."""
    out: dict[str, Any] = {"cases": []}
    base = make_experiences()
    for estimator, openrlhf_estimator in cases:
        case: dict[str, Any] = {"estimator": estimator, "openrlhf": openrlhf_estimator}
        if openrlhf_estimator is not None:
            adv_openrlhf.unpatch()
            own = maker(openrlhf_estimator).compute_advantages_and_returns(copy.deepcopy(base))
            case["own"] = by_index(own, "advantages")
        os.environ[adv_openrlhf.ENV_ESTIMATOR] = (
            estimator if isinstance(estimator, str) else json.dumps(estimator)
        )
        adv_openrlhf.setup()
        made = maker(openrlhf_estimator or "group_norm")
        sent = record_prompt_keys(made.advantage_service.backend)
        got = made.compute_advantages_and_returns(copy.deepcopy(base))
        order = [i for e in base for i in e.index]
        case["prompt_keys"] = dict(zip(order, sent[0].tolist(), strict=True)) if sent else {}
        case["service"] = by_index(got, "advantages")
        case["returns_equal"] = all(torch.equal(e.advantages, e.returns) for e in got)
        case["calls"] = len(made.advantage_service.calls)
        out["cases"].append(case)
        if "batch" not in out:
            out["batch"] = seen_batch(base, got)
    return out


def record_prompt_keys(backend: Any) -> list[Any]:
    """The prompt keys of the backend's next call, recorded as the call is made."""
    sent: list[Any] = []
    compute_padded = backend.compute_padded

    def recording(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs["prompt_keys"])
        return compute_padded(*args, **kwargs)

    backend.compute_padded = recording
    return sent


def seen_batch(base: list[Any], got: list[Any]) -> dict[int, Any]:
    """Per sample: its action tokens, its reward after the length penalties, its group and
    OpenRLHF's KL reward-to-go on its actions."""
    rewards = {i: float(r) for e in got for i, r in zip(e.index, e.rewards.tolist(), strict=True)}
    out = {}
    for e in base:
        kl_reward = -KL_COEF * e.kl * e.action_mask
        to_go = kl_reward.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        for row, index in enumerate(e.index):
            mask = e.action_mask[row]
            out[index] = {
                "tokens": e.sequences[row, 1:][mask].tolist(),
                "reward": rewards[index],
                "group": index // N_SAMPLES,
                "kl_to_go": to_go[row][mask].double().tolist(),
            }
    return out


def refusals() -> list[str]:
    """What the patched maker's construction says to a misspelt estimator, OpenRLHF's critic
    estimator and a discount."""
    said = []
    for estimator, openrlhf_estimator, gamma in (
        ("ktea", "group_norm", 1.0),
        ("grpo", "gae", 1.0),
        ("grpo", "group_norm", 0.99),
    ):
        adv_openrlhf.patch(estimator, "inprocess")
        args = make_args(openrlhf_estimator)
        args.algo.advantage.gamma = gamma
        maker_args = (None, None, None, None, None, SimpleNamespace(args=args), None)
        error = adv_openrlhf.OpenRLHFConfigError
        said.append(construction_said(error, RemoteExperienceMaker, *maker_args))
    return said


def main() -> None:
    """argv[1]: a JSON object: ``transports`` ([name, url or null] each), ``cases``."""
    print_result("openrlhf", adv_openrlhf, run_cases, refusals, clip=CLIP, prompts=PROMPT_IDS)


if __name__ == "__main__":
    main()
