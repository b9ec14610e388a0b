"""The verl integration on real verl 0.9.1 ``DataProto`` batches, through verl's own
``compute_advantage``: equal to verl's estimators for the outcome baselines, and to the oracle
for every preset (token-level ones through the patched ``compute_advantage``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from advantage_client import AdvantageError
from advantage_client.integrations import verl as adv_verl
from oracle import PRESETS
from padded_batches import ATOL, RTOL, PaddedCase, padded_case
from process_support import poll

pytest.importorskip("verl.trainer.ppo.ray_trainer")
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import ray_trainer

# Ours -> verl's own, with compute_advantage's norm_adv_by_std_in_grpo.
VERL_EQUIVALENTS = {
    "adv_grpo": ("grpo_vectorized", True),
    "adv_dr_grpo": ("grpo", False),
    "adv_rloo": ("rloo_vectorized", True),
    "adv_opo": ("opo", True),
    "adv_gpg": ("gpg", True),
    "adv_reinforce_pp_baseline": ("reinforce_plus_plus_baseline", True),
    "adv_grpo_passk": ("grpo_passk", True),
}


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    adv_verl.register()
    assert "verl.trainer.ppo.ray_trainer" in adv_verl.patch()
    yield
    adv_verl.unpatch()


def data_proto(case: PaddedCase) -> DataProto:
    """A DataProto as verl's trainer holds it: the reward on each response's last token."""
    mask = torch.from_numpy(case.mask)
    b, t = case.mask.shape
    rewards = torch.zeros(b, t)
    last = torch.where(mask.any(1), (mask * torch.arange(t)).argmax(1), torch.zeros(b).long())
    rewards[torch.arange(b), last] = torch.from_numpy(case.rewards).float()
    tensors: dict[str, torch.Tensor] = {
        "responses": torch.from_numpy(case.tokens),
        "response_mask": mask.long(),
        "token_level_rewards": rewards,
    }
    if case.logprobs is not None:
        tensors["old_log_probs"] = torch.from_numpy(case.logprobs).float()
    for name, values in case.teacher_logprobs.items():
        tensors[f"teacher_log_probs.{name}"] = torch.from_numpy(values).float()
    uids = np.array([str(g) for g in case.group_ids], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})


def advantages(data: DataProto, estimator: str, norm: bool = True) -> torch.Tensor:
    out = ray_trainer.compute_advantage(
        data, adv_estimator=estimator, norm_adv_by_std_in_grpo=norm, config=AlgoConfig()
    )
    assert torch.equal(out.batch["returns"], out.batch["advantages"]) or estimator in (
        "reinforce_plus_plus_baseline",
    )
    return out.batch["advantages"]


@pytest.mark.parametrize("ours", sorted(VERL_EQUIVALENTS))
@pytest.mark.parametrize("layout", ["right", "holes"])
def test_outcome_estimators_equal_verls_own(ours: str, layout: str) -> None:
    theirs, norm = VERL_EQUIVALENTS[ours]
    case = padded_case(
        31, "grpo", layout=layout, ids="uuid", n_groups=(4, 6), group_size=(2, 6), empty_prob=0
    )
    expected = advantages(data_proto(case), theirs, norm)
    got = advantages(data_proto(case), ours)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_equals_the_oracle_through_compute_advantage(preset: str) -> None:
    case = padded_case(32, preset, layout="mixed", ids="str", n_groups=(3, 5))
    got = advantages(data_proto(case), f"adv_{preset}")
    assert np.all(got.numpy()[~case.mask] == 0.0)
    np.testing.assert_allclose(got.numpy(), case.advantages, rtol=RTOL, atol=ATOL, err_msg=preset)


def test_a_token_level_estimator_without_patch_says_to_patch() -> None:
    adv_verl.unpatch()
    case = padded_case(33, "ktae")
    with pytest.raises(ValueError, match="patch"):
        advantages(data_proto(case), "adv_ktae")
    # an outcome estimator needs nothing patch() adds
    advantages(data_proto(case), "adv_grpo")


def test_named_estimator_objects_and_verls_own_estimators_untouched() -> None:
    adv_verl.register(presets={"my_rloo_ktae": {"outcome": "rloo", "ktae": {"scale": 0.5}}})
    case = padded_case(34, {"outcome": "rloo", "ktae": {"scale": 0.5}}, ids="int")
    got = advantages(data_proto(case), "adv_my_rloo_ktae")
    np.testing.assert_allclose(got.numpy(), case.advantages, rtol=RTOL, atol=ATOL)
    # grpo still takes verl's own branch of compute_advantage
    plain = padded_case(35, "grpo")
    np.testing.assert_allclose(
        advantages(data_proto(plain), "grpo").numpy(), plain.advantages, rtol=RTOL, atol=ATOL
    )


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_over_the_service(service: Any, transport: str) -> None:
    url = service.url if transport == "http" else service.target
    adv_verl.register(transport, url, presets=["ktae", "grpo"], ignore_token_ids=[1])
    before = service.requests(transport=transport)
    case = padded_case(36, "ktae", ignore_token_ids=[1])
    got = advantages(data_proto(case), "adv_ktae")
    np.testing.assert_allclose(got.numpy(), case.advantages, rtol=RTOL, atol=ATOL)
    assert service.requests(transport=transport) == before + 1


class CutFirstAnswer(httpx.HTTPTransport):
    """Real HTTP to the service; the first answer, once the service has sent it whole, is
    dropped as a connection cut before the client read it (the client retries the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST" and not self.cut:
            response.read()
            response.close()
            self.cut += 1
            raise httpx.RemoteProtocolError("server disconnected without sending a response")
        return response


@pytest.mark.integration
def test_a_call_retried_after_its_answer_was_cut_is_counted_once(service: Any) -> None:
    """Each call of a registered estimator carries its own request id, the same on its
    retries: a call the service answered and counted, whose answer the trainer never got, is
    counted once when the client sends it again; the next call counts again."""
    namespace = f"verl-retry-{uuid.uuid4().hex[:8]}"
    made = adv_verl.register("http", service.url, presets=["ktae"], namespace=namespace)
    client = made["adv_ktae"].compute_padded.__self__
    cutting = CutFirstAnswer()
    client.http = httpx.Client(base_url=service.url, timeout=60.0, transport=cutting)
    case = padded_case(48, "ktae", layout="right", empty_prob=0)
    before = service.requests(transport="http")

    def counted() -> int:
        stats = service.http.get("/v1/stats/tokens", params={"namespace": namespace}).json()
        return int(stats["rollouts_counted"])

    got = advantages(data_proto(case), "adv_ktae")
    np.testing.assert_allclose(got.numpy(), case.advantages, rtol=RTOL, atol=ATOL)
    assert cutting.cut == 1
    assert service.requests(transport="http") == before + 2  # answered twice ...
    poll(lambda: counted() > 0, 30, "the statistics written")
    time.sleep(0.5)
    rollouts = len(case.rewards)
    assert counted() == rollouts  # ... counted once
    advantages(data_proto(case), "adv_ktae")  # the next step's call: a call of its own
    poll(lambda: counted() == 2 * rollouts, 30, "the second call counted")


# ---- verl's settings, per-token rewards, failing early, restarts, packaging ---------------------


def test_norm_adv_by_std_in_grpo_false_is_honoured() -> None:
    """Today it was silently ignored: still divided by the std."""
    case = padded_case(40, "grpo", layout="right", ids="uuid", group_size=(2, 6), empty_prob=0)
    expected = advantages(data_proto(case), "grpo", norm=False)
    got = advantages(data_proto(case), "adv_grpo", norm=False)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=RTOL, atol=ATOL)
    # through the registered function alone (verl's own branch of compute_advantage passes
    # only config, which fit sets to config.algorithm), too
    adv_verl.unpatch()
    got = ray_trainer.compute_advantage(
        data_proto(case),
        adv_estimator="adv_grpo",
        norm_adv_by_std_in_grpo=False,
        config=AlgoConfig(norm_adv_by_std_in_grpo=False),
    ).batch["advantages"]
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("gamma", 0.99, "algorithm.gamma=1.0"),
        ("lam", 0.95, "algorithm.lam=1.0"),
        ("use_pf_ppo", True, "use_pf_ppo=false"),
        ("gdpo_reward_keys", ["a"], "gdpo_reward_keys"),
    ],
)
def test_settings_the_estimators_cannot_honour_are_refused(
    setting: str, value: Any, says: str
) -> None:
    case = padded_case(41, "grpo")
    config = AlgoConfig(**{setting: value})
    with pytest.raises(adv_verl.VerlConfigError, match=says):
        ray_trainer.compute_advantage(data_proto(case), adv_estimator="adv_grpo", config=config)


def test_an_estimator_that_fixes_norm_by_std_against_verls_setting_is_refused() -> None:
    adv_verl.register(presets={"std": {"outcome": {"name": "grpo", "norm_by_std": True}}})
    case = padded_case(42, "grpo")
    with pytest.raises(adv_verl.VerlConfigError, match="make them agree"):
        advantages(data_proto(case), "adv_std", norm=False)


def spread_rewards(case: PaddedCase, rng: np.random.Generator) -> torch.Tensor:
    """Token-level rewards spread over each response (verl's KL penalty in the reward)."""
    values = rng.normal(0, 0.2, size=case.mask.shape) * case.mask
    return torch.from_numpy(values).float()


def otb_batches(
    rng: np.random.Generator, first_seed: int, count: int
) -> Iterator[tuple[PaddedCase, DataProto, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``count`` random batches for OTB, each (case, its DataProto, token-level rewards, old
    log-probs, sums of squared probabilities): the DataProto holds the rewards and the inputs
    in float32; the log-probs and sums come in float64, as drawn."""
    for seed in range(first_seed, first_seed + count):
        case = padded_case(seed, "grpo", layout="right", ids="str", group_size=(2, 5), empty_prob=0)
        data = data_proto(case)
        rewards = spread_rewards(case, rng)
        logprobs = torch.from_numpy(-rng.uniform(0.01, 3, size=case.mask.shape))
        spp = torch.from_numpy(rng.uniform(0.05, 1, size=case.mask.shape))
        data.batch["token_level_rewards"] = rewards
        data.batch["old_log_probs"] = logprobs.float()
        data.batch["sum_pi_squared"] = spp.float()
        yield case, data, rewards, logprobs, spp


def test_otb_uses_the_reward_to_go_of_per_token_rewards_as_verl_does() -> None:
    # The issue's example: verl [[.5, .25], [-.5, -.25]]; the service gave [[.5, .5], [-.5, -.5]].
    fn = adv_verl.REGISTERED["adv_otb"]
    mask = torch.ones(2, 2)
    got, _ = fn(
        torch.tensor([[0.5, 0.5], [0.0, 0.0]]),
        mask,
        np.array(["g", "g"], dtype=object),
        AlgoConfig(),
        responses=torch.tensor([[1, 2], [3, 4]]),
        old_log_probs=torch.full((2, 2), -1.0),
        sum_pi_squared=torch.full((2, 2), 0.5),
    )
    np.testing.assert_allclose(got.numpy(), [[0.5, 0.25], [-0.5, -0.25]], atol=1e-6)
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage

    for case, data, rewards, logprobs, spp in otb_batches(np.random.default_rng(43), 60, 5):
        mask = torch.from_numpy(case.mask).float()
        expected, _ = compute_optimal_token_baseline_advantage(
            rewards, mask, data.non_tensor_batch["uid"], logprobs.float(), spp.float()
        )
        got = advantages(data, "adv_otb")
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)


def test_otb_sends_verls_importance_sampling_weights() -> None:
    """An optional input the batch has and the estimator reads is sent: OTB with verl's
    ``rollout_is_weights`` is verl's truncated-IS OTB (the issue's example: verl
    [[0.0588, 0.0588], [-0.941, -0.941]]; the weights were dropped and the answer was
    [[0.5, 0.5], [-0.5, -0.5]], 824 of 840 random batches off by up to 2.3)."""
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage

    fn = adv_verl.REGISTERED["adv_otb"]
    weights = torch.tensor([[2.0, 2.0], [0.5, 0.5]])
    got, _ = fn(
        torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
        torch.ones(2, 2),
        np.array(["g", "g"], dtype=object),
        AlgoConfig(),
        responses=torch.tensor([[1, 2], [3, 4]]),
        old_log_probs=torch.full((2, 2), float(np.log(0.5))),
        sum_pi_squared=torch.full((2, 2), 0.5),
        rollout_is_weights=weights,
    )
    expected, _ = compute_optimal_token_baseline_advantage(
        torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64),
        torch.ones(2, 2, dtype=torch.float64),
        np.array(["g", "g"], dtype=object),
        torch.full((2, 2), np.log(0.5), dtype=torch.float64),
        torch.full((2, 2), 0.5, dtype=torch.float64),
        rollout_is_weights=weights.double(),
    )
    np.testing.assert_allclose(expected.numpy(), [[1 / 17, 1 / 17], [-16 / 17, -16 / 17]])
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5)

    rng = np.random.default_rng(44)
    for case, data, rewards, logprobs, spp in otb_batches(rng, 70, 8):
        is_weights = torch.from_numpy(rng.uniform(0.2, 2.0, size=case.mask.shape))
        data.batch["rollout_is_weights"] = is_weights.float()
        mask = torch.from_numpy(case.mask).double()
        expected, _ = compute_optimal_token_baseline_advantage(
            rewards.double(),
            mask,
            data.non_tensor_batch["uid"],
            logprobs.float().double(),
            spp.float().double(),
            rollout_is_weights=is_weights.float().double(),
        )
        got = advantages(data, "adv_otb")
        scale = float(expected.abs().max())
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=1e-5 * scale)


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_otb_over_the_service_takes_returns_and_weights(service: Any, transport: str) -> None:
    """verl's OTB over HTTP and gRPC: the integration sends ``returns`` (the reward-to-go) and
    the IS weights, which every client's compute_padded takes (before: TypeError)."""
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage

    url = service.url if transport == "http" else service.target
    adv_verl.register(transport, url, presets=["otb"])
    rng = np.random.default_rng(45)
    case = padded_case(80, "grpo", layout="right", ids="str", group_size=(2, 5), empty_prob=0)
    data = data_proto(case)
    rewards = spread_rewards(case, rng)
    data.batch["token_level_rewards"] = rewards
    for name, low, high in (
        ("old_log_probs", -3, -0.01),
        ("sum_pi_squared", 0.05, 1),
        ("rollout_is_weights", 0.2, 2),
    ):
        data.batch[name] = torch.from_numpy(rng.uniform(low, high, size=case.mask.shape)).float()
    before = service.requests(transport=transport)
    got = advantages(data, "adv_otb")
    expected, _ = compute_optimal_token_baseline_advantage(
        rewards.double(),
        torch.from_numpy(case.mask).double(),
        data.non_tensor_batch["uid"],
        data.batch["old_log_probs"].double(),
        data.batch["sum_pi_squared"].double(),
        rollout_is_weights=data.batch["rollout_is_weights"].double(),
    )
    scale = float(expected.abs().max())
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=1e-5 * scale)
    assert service.requests(transport=transport) == before + 1


def test_outcome_estimators_sum_per_token_rewards_as_verls_own() -> None:
    rng = np.random.default_rng(44)
    case = padded_case(45, "grpo", layout="right", ids="uuid", group_size=(2, 6), empty_prob=0)
    rewards = spread_rewards(case, rng)
    theirs, ours = data_proto(case), data_proto(case)
    theirs.batch["token_level_rewards"] = rewards
    ours.batch["token_level_rewards"] = rewards.clone()
    np.testing.assert_allclose(
        advantages(ours, "adv_rloo").numpy(),
        advantages(theirs, "rloo_vectorized").numpy(),
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.mark.parametrize(
    ("presets", "says"),
    [
        (["grpoo"], "unknown estimator 'grpoo'"),
        ({"x": {"outcome": "rlooo"}}, "unknown outcome baseline 'rlooo'"),
        ({"x": {"outcome": "grpo", "ktae": {"scal": 1}}}, "no parameter 'scal'"),
        ({"x": {"outcome": "grpo", "cscr": {"strength": 2.0}}}, "strength must be <= 1"),
        ({"x": {"outcome": "grpo", "ktae": {"history": "always"}}}, "must be one of"),
    ],
)
def test_a_bad_estimator_fails_at_registration_not_at_the_first_step(
    presets: Any, says: str
) -> None:
    with pytest.raises(adv_verl.VerlConfigError, match=says):
        adv_verl.register(presets=presets)


@pytest.mark.integration
def test_bad_estimators_are_checked_against_the_services_listing(service: Any) -> None:
    with pytest.raises(adv_verl.VerlConfigError, match="unknown estimator 'ktea'"):
        adv_verl.register("http", service.url, presets=["ktea"])


def test_missing_inputs_say_what_to_set_in_verl() -> None:
    case = padded_case(46, "otb")
    data = data_proto(case)
    data.batch.pop("sum_pi_squared", None)
    with pytest.raises(adv_verl.VerlConfigError, match="calculate_sum_pi_squared=True"):
        advantages(data, "adv_otb")
    from omegaconf import OmegaConf

    v1 = OmegaConf.create(
        {"algorithm": {}, "trainer": {"use_v1": True}, "actor_rollout_ref": {"actor": {}}}
    )
    with pytest.raises(adv_verl.VerlConfigError, match=r"trainer\.use_v1=false"):
        adv_verl.REGISTERED["adv_otb"].check_config(v1)


def test_the_setup_hook_reads_its_settings_from_the_environment() -> None:
    env = adv_verl.runtime_env(
        "http", "http://a:1", presets=["grpo"], estimators={"k": {"ktae": {}}}, namespace="n"
    )
    assert env["worker_process_setup_hook"] == "advantage_client.integrations.verl.setup"
    settings = adv_verl.settings_from_env(env["env_vars"])
    assert settings == {
        "transport": "http",
        "url": "http://a:1",
        "presets": {"grpo": "grpo", "k": {"ktae": {}}},
        "namespace": "n",
    }


@pytest.mark.integration
def test_a_service_down_past_the_retries_falls_back_to_verls_own_when_asked(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from trainer_support import TrainerService

    srv = TrainerService.start(tmp_path_factory.mktemp("down"))
    try:
        made = adv_verl.register("http", srv.url, presets=["grpo"], fallback=True, retries=1)
        strict = adv_verl.register("http", srv.url, presets={"strict": "grpo"}, retries=1)
        # the default wait of a registered client rides out a rolling restart
        default = adv_verl.register("http", srv.url, presets={"default": "grpo"})
        assert default["adv_default"].compute_padded.__self__.retry.retry_for >= 60
    finally:
        srv.stop()
    case = padded_case(47, "grpo", layout="right", ids="uuid", group_size=(2, 6), empty_prob=0)
    expected = advantages(data_proto(case), "grpo_vectorized")
    got = advantages(data_proto(case), "adv_grpo")
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=RTOL, atol=ATOL)
    assert adv_verl.FALLBACK_CALLS["adv_grpo"] >= 1 and "adv_grpo" in made
    with pytest.raises(AdvantageError, match="cannot reach"):
        advantages(data_proto(case), "adv_strict")
    assert "adv_strict" in strict
    with pytest.raises(adv_verl.VerlConfigError, match="outcome-only"):
        adv_verl.register(presets=["ktae"], fallback=True)


def test_the_verl_extra_declares_the_tested_version_range() -> None:
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = Path(__file__).resolve().parents[2] / "clients/python/pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    (verl,) = [Requirement(r) for r in extras["verl"] if r.startswith("verl")]
    assert importlib.metadata.version("verl") in verl.specifier


def _blake(ids: list[int]) -> str:
    import hashlib

    data = np.asarray(ids, dtype="<i8").tobytes()
    return "p:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def test_prompt_keys_hash_each_prompts_own_tokens_once_per_uid() -> None:
    """History keys: per uid, a hash of its prompt's tokens without the padding, whatever the
    padding and the row order; every row of a uid gets it (legacy trainer, and the v1
    trainer's fetch mapped back onto the step's uids)."""
    made = adv_verl.register(presets={"hist": {"outcome": "grpo", "ktae": {"history": "prompt"}}})
    fn = made["adv_hist"]
    seen: dict[str, Any] = {}
    real = fn.compute_padded

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return real(*args, **kwargs)

    fn.compute_padded = spy
    pad = 0
    # uids a, b and c; a and c share the prompt [5, 6, 7] under different left padding
    prompts = torch.tensor(
        [[pad, 5, 6, 7], [9, 8, 1, 2], [5, 6, 7, pad], [pad, 5, 6, 7], [9, 8, 1, 2]]
    )
    prompt_mask = (prompts != pad).long()
    uids = np.array(["a", "b", "c", "a", "b"], dtype=object)
    responses = torch.tensor([[3, 4], [3, 3], [4, 4], [4, 3], [3, 4]])
    response_mask = torch.ones_like(responses)
    rewards = torch.zeros(5, 2)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    data = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "token_level_rewards": rewards,
        },
        non_tensors={"uid": uids},
    )
    advantages(data, "adv_hist")
    keys = list(seen["prompt_keys"])
    want = [_blake([5, 6, 7]), _blake([9, 8, 1, 2]), _blake([5, 6, 7])]
    assert keys == [want[0], want[1], want[2], want[0], want[1]]
    # The v1 trainer: its fetch brings (uid, prompt rows) in any order; the step's rows map back.
    fetched = adv_verl.prompt_hashes(
        [torch.tensor([9, 8, 1, 2]), torch.tensor([5, 6, 7])], np.array(["b", "a"])
    )
    token = adv_verl._V1_STEP.set({"estimator": fn, "prompt_keys": (np.array(["b", "a"]), fetched)})
    try:
        assert list(adv_verl._prompt_keys(data, fn, np.array(["a", "b", "a"]))) == [
            want[0],
            want[1],
            want[0],
        ]
        with pytest.raises(adv_verl.VerlConfigError, match="'z' was not fetched"):
            adv_verl._prompt_keys(data, fn, np.array(["a", "z"]))
    finally:
        adv_verl._V1_STEP.reset(token)
