"""The TRL integration: real ``GRPOTrainer`` runs (CPU) of a tiny randomly initialised Llama with
a tokenizer trained in memory (clients/examples/trl_tiny.py), nothing downloaded, against a real
service process; and, on two ranks, under ``torchrun`` with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("trl")
import numpy as np
import pandas as pd
import torch
from advantage_client.integrations import fallback
from advantage_client.integrations.trl import AdvantageGRPOTrainer, prompt_key
from datasets import Dataset
from process_support import free_port
from trainer_support import tiny_grpo_config
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "clients" / "examples"
sys.path.insert(0, str(EXAMPLES))
from trl_tiny import tiny_model, tiny_tokenizer  # noqa: E402

TEXT = "the cat sat on a mat and the dog ran to it so we all saw one red ball"
WORDS = TEXT.split()
PROMPTS = [" ".join(WORDS[i : i + 3]) for i in range(8)]


def odd_words(completions: list[str], **kwargs: Any) -> list[float]:
    """1 for a completion with an odd number of 'the', else 0: some of each in a group."""
    return [float(c.split().count("the") % 2) for c in completions]


def cycling(values: list[float | None]) -> Callable[..., list[float | None]]:
    """A reward function giving each group's rows ``values`` in order (groups are consecutive
    rows of num_generations = len(values))."""

    def reward(completions: list[str], **kwargs: Any) -> list[float | None]:
        return [values[i % len(values)] for i in range(len(completions))]

    return reward


def config(tmp_path: Path, **overrides: Any) -> GRPOConfig:
    settings: dict[str, Any] = {
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "seed": 0,
        "temperature": 1.5,
    }
    return tiny_grpo_config(tmp_path, **{**settings, **overrides})


def trainer_of(
    tmp_path: Path,
    reward: Any = odd_words,
    dataset: Dataset | None = None,
    cls: type = AdvantageGRPOTrainer,
    config_options: dict[str, Any] | None = None,
    **advantage: Any,
) -> Any:
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    return cls(
        model=tiny_model(tokenizer, hidden=16),
        reward_funcs=reward,
        args=config(tmp_path, **(config_options or {})),
        train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        **advantage,
    )


class Recording(AdvantageGRPOTrainer):  # type: ignore[misc]
    """Keeps what each call sent (the keyword arguments of compute_padded) and what the loss
    trained on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[dict[str, Any]] = []
        self.trained: list[torch.Tensor] = []
        self.outputs: list[dict[str, Any]] = []
        inner = self._compute_padded

        def spy(*a: Any, **kw: Any) -> Any:
            self.sent.append({"args": a, **kw})
            return inner(*a, **kw)

        self._compute_padded = spy

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        self.outputs.append(output)
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self.trained.append(inputs["advantages"].detach().clone())
        return super()._compute_loss(model, inputs)


def row_values(advantages: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The one value of each row of an outcome-only estimator's advantages (checked constant)."""
    out = []
    for row, m in zip(advantages, mask.bool(), strict=True):
        values = torch.unique(row[m])
        assert values.numel() <= 1, row
        out.append(float(values[0]) if values.numel() else 0.0)
    return out


# ---- the whole run ------------------------------------------------------------------------------


@pytest.mark.integration
def test_grpo_trainer_trains_on_the_services_per_token_advantages(
    tmp_path: Path, service: Any
) -> None:
    before = service.requests(transport="http", estimator="grpo+ktae")
    ktae = trainer_of(
        tmp_path,
        cls=Recording,
        config_options={"max_steps": 2},
        advantage_estimator="ktae",
        advantage_transport="http",
        advantage_url=service.url,
    )
    ktae.train()
    assert ktae.state.global_step == 2
    assert service.requests(transport="http", estimator="grpo+ktae") >= before + 2
    # KTAE: advantages differ between the tokens of one completion
    assert any(len(torch.unique(row[row != 0])) > 1 for a in ktae.trained for row in a)

    before = service.requests(transport="http", estimator="grpo")
    # advantage_url alone: HTTP (the transport defaults to it when a URL is given)
    grpo = trainer_of(
        tmp_path, cls=Recording, advantage_estimator="grpo", advantage_url=service.url
    )
    grpo.train()
    assert service.requests(transport="http", estimator="grpo") == before + 1
    assert all(len(torch.unique(row[row != 0])) <= 1 for a in grpo.trained for row in a)
    assert any(bool((a != 0).any()) for a in grpo.trained)


# ---- several ranks: one call, the same numbers everywhere, history per prompt --------------------


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_ranks_share_one_call_and_history_follows_the_prompt(
    tmp_path: Path, service: Any
) -> None:
    namespace = f"trl-ranks-{uuid.uuid4().hex[:8]}"
    before = service.requests(transport="http", estimator="grpo+ktae")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(Path(__file__).with_name("trl_ranks_worker.py")),
            service.url,
            namespace,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
        check=False,
    )
    # (a hung rank dumps its threads' stacks to stderr before it exits: trl_ranks_worker.py)
    assert run.returncode == 0, run.stderr[-12000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    steps0, steps1 = ranks[0]["steps"], ranks[1]["steps"]
    assert len(steps0) == len(steps1) == 3
    # one call per step, for the whole group set: 3 requests, each rollout counted once
    assert service.requests(transport="http", estimator="grpo+ktae") == before + 3
    stats = service.http.get("/v1/stats/tokens", params={"namespace": namespace}).json()
    assert stats["rollouts_counted"] == 3 * 4
    seen: set[str] = set()
    for a, b in zip(steps0, steps1, strict=True):
        # every rank trains on the same advantages, each its own rows of them
        assert a["all"] == b["all"]
        assert a["prompts"] == b["prompts"] and len(a["prompts"]) == 1
        for rank, step in ((0, a), (1, b)):
            rows = np.asarray(step["all"])[2 * rank : 2 * rank + 2]
            local = np.asarray(step["local"])
            assert np.array_equal(rows[:, : local.shape[1]], local)
        # history applies exactly when this prompt was trained on before
        prompt = a["prompts"][0]
        assert a["call"]["history"] == ("applied" if prompt in seen else "empty"), (prompt, seen)
        seen.add(prompt)
    assert len(seen) == 2  # (the dataset revisits one of its two prompts)


# ---- rows without a reward ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def none_rewards_run(tmp_path_factory: pytest.TempPathFactory, service: Any) -> Iterator[Any]:
    """One step with each group's rewards [None, 2, 0, 1], completions logged."""
    tmp_path = tmp_path_factory.mktemp("trl-none")
    trainer = trainer_of(
        tmp_path,
        reward=cycling([None, 2.0, 0.0, 1.0]),
        cls=Recording,
        config_options={"log_completions": True},
        advantage_estimator="grpo",
        advantage_url=service.url,
    )
    trainer.train()
    yield trainer


@pytest.mark.integration
def test_rows_without_a_reward_leave_the_baseline_and_get_zero(none_rewards_run: Any) -> None:
    trainer = none_rewards_run
    mask = trainer.outputs[0]["completion_mask"]
    values = row_values(trainer.last_all_advantages, mask)
    # TRL's own: [0, 1, -1, 0] per group (mean 1, std 1 over the three scored rows)
    expected = [0.0, 1.0, -1.0, 0.0] * 2
    assert np.allclose(values, expected, atol=1e-4), values
    # the unscored rows were not sent at all
    assert len(trainer.sent[0]["args"][2]) == 6


@pytest.mark.integration
def test_logged_advantages_are_the_trained_ones_with_the_call_metrics(
    none_rewards_run: Any,
) -> None:
    trainer = none_rewards_run
    mask = trainer.outputs[0]["completion_mask"]
    trained = trainer.last_all_advantages
    per_row = ((trained * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    table = pd.read_parquet(
        Path(trainer.args.output_dir) / "completions" / "completions_00001.parquet"
    )
    assert np.allclose(table["advantage"].to_numpy(), per_row, atol=1e-6)
    logged = next(h for h in trainer.state.log_history if "advantage_service/call_ms" in h)
    assert logged["advantage_service/call_ms"] > 0
    assert (
        logged["advantage_service/history_empty"] + logged["advantage_service/history_applied"] <= 1
    )
    assert logged["advantage_service/fallback"] == 0


# ---- TRL's settings ---------------------------------------------------------------------------


@pytest.mark.integration
def test_scale_rewards_none_is_honoured(tmp_path: Path, service: Any) -> None:
    trainer = trainer_of(
        tmp_path,
        reward=cycling([0.0, 2.0, 0.0, 1.0]),
        config_options={"scale_rewards": "none"},
        advantage_estimator="grpo",
        advantage_url=service.url,
    )
    trainer.train()
    mask = torch.as_tensor(trainer.last_all_advantages != 0)
    values = row_values(trainer.last_all_advantages, mask)
    # TRL's own with scale_rewards="none": r - mean, no division by the std
    assert np.allclose(values, [-0.75, 1.25, -0.75, 0.25] * 2, atol=1e-6), values


class TrlOwn(GRPOTrainer):  # type: ignore[misc]
    """TRL's own trainer, keeping the advantages it computed."""

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        self.own = output["advantages"].detach().clone()
        return output


@pytest.mark.integration
def test_scale_rewards_batch_is_trls_own(tmp_path: Path, service: Any) -> None:
    """Each group's mean, the whole batch's std (groups of different spreads, an unscored row
    left out of both): TRL's own advantages, from the same rewards."""
    reward = cycling([None, 2.0, 0.0, 1.0, 3.0, 0.5, 3.0, 3.0])
    options = {"scale_rewards": "batch"}
    ours = trainer_of(
        tmp_path,
        reward=reward,
        cls=Recording,
        config_options=options,
        advantage_estimator={"outcome": {"name": "grpo", "epsilon": 1e-4}},
        advantage_url=service.url,
    )
    ours.train()
    own = trainer_of(tmp_path, reward=reward, cls=TrlOwn, config_options=options)
    own.train()
    expected = own.own.double().numpy()
    rewards = np.array([np.nan, 2.0, 0.0, 1.0, 3.0, 0.5, 3.0, 3.0])
    scored = rewards[1:]
    assert np.allclose(expected[1:4], (scored[:3] - 1.0) / (scored.std(ddof=1) + 1e-4))
    values = np.asarray(row_values(ours.last_all_advantages, ours.outputs[0]["completion_mask"]))
    assert np.abs(values - expected).max() <= 1e-5 * np.abs(expected).max(), (values, expected)


@pytest.mark.parametrize(
    ("options", "estimator", "says"),
    [
        ({"scale_rewards": "batch"}, "dr_grpo", "only the grpo outcome"),
        (
            {"scale_rewards": "batch"},
            {"outcome": {"name": "grpo", "norm_by_std": False}},
            "norm_by_std=False",
        ),
        (
            {"scale_rewards": "batch"},
            {"outcome": {"name": "grpo", "std_scope": "group"}},
            "std_scope='group'",
        ),
        (
            {"scale_rewards": "group"},
            {"outcome": {"name": "grpo", "std_scope": "request"}},
            "scale_rewards='batch'",
        ),
        ({"multi_objective_aggregation": "normalize_then_sum"}, "grpo", "normalize_then_sum"),
        (
            {"scale_rewards": "none"},
            {"outcome": {"name": "grpo", "norm_by_std": True}},
            "norm_by_std",
        ),
    ],
)
def test_trl_settings_the_service_cannot_honour_are_refused(
    tmp_path: Path, options: dict[str, Any], estimator: Any, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        AdvantageGRPOTrainer(
            model="no/such-model",  # (refused before any model loads)
            reward_funcs=odd_words,
            args=config(tmp_path, **options),
            advantage_estimator=estimator,
            advantage_transport="inprocess",
        )


def test_the_local_fallback_cannot_stand_in_for_batch_scaling(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="advantage_fallback='local' divides by each group's"):
        AdvantageGRPOTrainer(
            model="no/such-model",
            reward_funcs=odd_words,
            args=config(tmp_path, scale_rewards="batch"),
            advantage_estimator="grpo",
            advantage_transport="inprocess",
            advantage_fallback="local",
        )


# ---- failing early -------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    ("estimator", "says"),
    [
        ("ktea", "unknown estimator 'ktea'"),
        ({"outcome": "grpo", "ktae": {"history": "forever"}}, "estimator.ktae.history"),
        ({"outcome": "grpo", "ktae": {"scales": 2}}, "no parameter 'scales'"),
    ],
)
def test_a_bad_estimator_fails_before_the_model_loads(
    tmp_path: Path, service: Any, estimator: Any, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        AdvantageGRPOTrainer(
            model="no/such-model",
            reward_funcs=odd_words,
            args=config(tmp_path),
            advantage_estimator=estimator,
            advantage_url=service.url,
        )


def test_an_estimator_needing_inputs_trl_lacks_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="advantage_extra_forward=True"):
        trainer_of(tmp_path, advantage_estimator="otb", advantage_transport="inprocess")
    with pytest.raises(ValueError, match="advantage_teacher_logprobs"):
        trainer_of(tmp_path, advantage_estimator="cscr", advantage_transport="inprocess")


def test_inprocess_without_the_service_package_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment without the service package: no ``advantage_contract.backends`` entry
    point (how the client finds the in-process backend; it never imports the service)."""
    import advantage_contract.backend

    monkeypatch.setattr(advantage_contract.backend, "entry_points", lambda **_: ())
    with pytest.raises(ModuleNotFoundError, match=r"pip install advantage-service.*advantage_url"):
        AdvantageGRPOTrainer(model="no/such-model", reward_funcs=odd_words, args=config(tmp_path))


# ---- per-token inputs -------------------------------------------------------------------------


@pytest.mark.integration
def test_extra_forward_gives_otb_and_forking_what_trl_would_compute(
    tmp_path: Path, service: Any
) -> None:
    trainer = trainer_of(
        tmp_path,
        cls=Recording,
        advantage_estimator={"outcome": "otb", "forking": {}},
        advantage_url=service.url,
        advantage_extra_forward=True,
    )
    trainer.train()
    sent, output = trainer.sent[0], trainer.outputs[0]
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    width = output["completion_ids"].shape[1]
    # TRL's own log-probs and entropies of the model before the step (recomputed from the
    # weights it had: the step is undone by evaluating a fresh copy at the same seed)
    fresh = trainer_of(tmp_path, advantage_estimator="grpo", advantage_transport="inprocess")
    fresh.model.eval()
    with torch.no_grad():
        logps, entropies, _ = fresh._get_per_token_logps_and_entropies(
            fresh.model, ids, attention, width, compute_entropy=True
        )
    mask = output["completion_mask"].bool()
    assert torch.allclose(torch.as_tensor(sent["logprobs"])[mask], logps[mask], atol=1e-4)
    assert torch.allclose(torch.as_tensor(sent["entropy"])[mask], entropies[mask], atol=1e-4)
    spsq = torch.as_tensor(sent["sum_pi_squared"])[mask]
    assert bool(((spsq > 0) & (spsq <= 1)).all())
    # OTB's advantages vary along a completion
    assert any(len(torch.unique(row[row != 0])) > 1 for row in trainer.last_all_advantages)


@pytest.mark.integration
def test_trls_old_logprobs_and_a_teacher_callable_feed_opsd(tmp_path: Path, service: Any) -> None:
    def teacher(inputs: list[dict[str, Any]], ids: torch.Tensor, mask: torch.Tensor) -> Any:
        return {"pos": torch.full(ids.shape, -0.5)}

    trainer = trainer_of(
        tmp_path,
        cls=Recording,
        # two iterations per generation: TRL computes old log-probs itself
        config_options={"num_iterations": 2, "max_steps": 2},
        advantage_estimator="opsd",
        advantage_url=service.url,
        advantage_teacher_logprobs=teacher,
    )
    trainer.train()
    sent, output = trainer.sent[0], trainer.outputs[0]
    assert torch.equal(torch.as_tensor(sent["logprobs"]), output["old_per_token_logps"])
    assert set(sent["teacher_logprobs"]) == {"pos"}
    assert any(len(torch.unique(row[row != 0])) > 1 for row in trainer.last_all_advantages)


@pytest.mark.integration
def test_a_teacher_prompt_column_feeds_cscr(tmp_path: Path, service: Any) -> None:
    dataset = Dataset.from_dict(
        {
            "prompt": PROMPTS,
            "good": [f"the right answer to {p} is" for p in PROMPTS],
            "bad": [f"a wrong answer to {p} is" for p in PROMPTS],
        }
    )
    trainer = trainer_of(
        tmp_path,
        dataset=dataset,
        cls=Recording,
        # (onset 0: the tiny random model's small sensitivities still move the credit)
        advantage_estimator={"outcome": "grpo", "cscr": {"onset": 0.0, "decay": 1000.0}},
        advantage_url=service.url,
        advantage_teacher_logprobs={"pos": "good", "neg": "bad"},
    )
    trainer.train()
    sent, output = trainer.sent[0], trainer.outputs[0]
    mask = output["completion_mask"].bool()
    assert set(sent["teacher_logprobs"]) == {"pos", "neg"}
    pos, neg = (torch.as_tensor(sent["teacher_logprobs"][c]) for c in ("pos", "neg"))
    assert bool((pos[mask] < 0).all()) and not torch.equal(pos[mask], neg[mask])
    assert any(len(torch.unique(row[row != 0])) > 1 for row in trainer.last_all_advantages)


# ---- an unreachable service --------------------------------------------------------------------


def test_local_fallback_answers_outcome_estimators_when_the_service_is_gone(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    trainer = trainer_of(
        tmp_path,
        reward=cycling([0.0, 2.0, 0.0, 1.0]),
        advantage_estimator="grpo",
        advantage_url=dead,
        advantage_options={"retry_for": 0.3},
        advantage_fallback="local",
    )
    trainer.train()
    assert trainer.advantage_calls[-1]["fallback"] is True
    mask = torch.as_tensor(trainer.last_all_advantages != 0)
    values = row_values(trainer.last_all_advantages, mask)
    std = float(np.std([0, 2, 0, 1], ddof=1))
    assert np.allclose(values, [(r - 0.75) / (std + 1e-6) for r in (0, 2, 0, 1)] * 2, atol=1e-6)
    logged = next(h for h in trainer.state.log_history if "advantage_service/fallback" in h)
    assert logged["advantage_service/fallback"] == 1
    with pytest.raises(ValueError, match="token-level terms"):
        trainer_of(
            tmp_path,
            advantage_estimator="ktae",
            advantage_transport="inprocess",
            advantage_fallback="local",
        )


@pytest.mark.parametrize("outcome", ["grpo", "dr_grpo", "rloo", "reinforce"])
def test_local_fallback_equals_the_service(outcome: str) -> None:
    advantage_service = pytest.importorskip("advantage_service")
    rng = np.random.default_rng(0)
    groups = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])  # (group 2: a group of one)
    rewards = rng.integers(0, 3, size=groups.size).astype(np.float64)
    rewards[3:5] = 1.0  # a group of equal rewards
    mask = np.ones((groups.size, 3), dtype=bool)
    service = advantage_service.compute_padded(None, mask, rewards, groups, estimator=outcome)
    resolved = advantage_service.resolve_estimator(outcome).to_dict()
    local = fallback.outcome_scalars(resolved, rewards, groups)
    assert np.allclose(local, service.advantages[:, 0], atol=1e-6)


# ---- packaging and the example -------------------------------------------------------------------


def test_the_trl_extra_names_a_range_the_tested_trl_is_in() -> None:
    import tomllib

    import trl
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())
    extra = [Requirement(r) for r in project["project"]["optional-dependencies"]["trl"]]
    spec = next(r.specifier for r in extra if r.name == "trl")
    assert spec and trl.__version__ in spec
    assert "trl" in {r.name for r in extra}


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_example_trains_against_the_service(tmp_path: Path, service: Any) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "trl_tiny.py"),
            "--url",
            service.url,
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--generations",
            "4",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(0 <= x["reward"] <= 1 and 0 <= x["pass_rate"] <= 1 for x in lines)
    assert all(x["call_ms"] > 0 for x in lines)


@pytest.mark.parametrize(
    "estimator",
    [
        "grpo",
        "ktae",
        "otb",
        "reinforce_pp_baseline",
        {"outcome": {"name": "grpo", "norm_by_std": False}, "ktae": {"history": "prompt"}},
        {"outcome": "rloo", "cscr": {"positive": "a", "negative": "b"}, "clip": 2.0},
    ],
)
def test_the_listing_check_resolves_as_the_service_does(estimator: Any) -> None:
    advantage_service = pytest.importorskip("advantage_service")
    from advantage_client.integrations import checks
    from advantage_service.wire.listing import estimator_listing

    listing = json.loads(json.dumps(estimator_listing()))
    assert (
        checks.resolve(listing, estimator)
        == advantage_service.resolve_estimator(estimator).to_dict()
    )


def test_prompt_keys_are_a_hash_of_the_prompt_or_a_dataset_column(tmp_path: Path) -> None:
    ids = [f"q{i % 4}" for i in range(len(PROMPTS))]
    dataset = Dataset.from_dict({"prompt": PROMPTS, "pid": ids})
    by_column = trainer_of(
        tmp_path,
        dataset=dataset,
        cls=Recording,
        advantage_transport="inprocess",
        advantage_prompt_key="pid",
    )
    by_column.train()
    keys = list(by_column.sent[0]["prompt_keys"])
    assert set(keys) <= set(ids) and len(keys) == 8
    assert all(len(set(keys[g : g + 4])) == 1 for g in (0, 4))  # one key per group
    hashed = trainer_of(tmp_path, cls=Recording, advantage_transport="inprocess")
    hashed.train()
    keys = list(hashed.sent[0]["prompt_keys"])
    output = hashed.outputs[0]
    for row in range(8):
        prompt = output["prompt_ids"][row][output["prompt_mask"][row].bool()]
        assert keys[row] == prompt_key(prompt.tolist())
    assert len(set(keys)) == 2  # two prompts of four completions each
