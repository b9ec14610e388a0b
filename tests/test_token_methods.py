"""The token-level methods (forking tokens, OTB, GTPO, GRPO-S, HICRA; MaxRL beside them) as
estimators: alone and composed, through ``compute_batch`` and the JSON API
(``advantage_service.compute``) against the oracle, the pipeline's order (OTB's and GTPO's a_it in
the formula, HICRA after whitening and clipping, the forking mask last), the listing of the
inputs each needs, and every request error the new inputs and parameters add, in-process and
through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import oracle
import pytest
import torch
from advantage_service import RequestError, RolloutBatch, compute, compute_batch
from advantage_service.cli import main as cli_main
from advantage_service.wire.listing import estimator_listing
from token_cases import ERROR_CASES, ERROR_IDS, check_listing, token_request

TOL = 2e-5

ESTIMATORS: dict[str, Any] = {
    "otb": "otb",
    "forking": "forking",
    "otb(no zero tail)": {"outcome": {"name": "otb", "handle_zero_tail": False}},
    "forking(rho=1)": {"forking": {"rho": 1.0}},
    "forking(group)": {"forking": {"scope": "group", "rho": 0.5}},
    "otb+ktae": {"outcome": "otb", "ktae": {}},
    "rloo+cscr+forking": {"outcome": "rloo", "cscr": {}, "forking": {}},
    "otb+ktae+forking(group)+whiten+clip": {
        "outcome": "otb",
        "ktae": {},
        "forking": {"scope": "group"},
        "whiten": True,
        "clip": 0.75,
    },
    "maxrl": "maxrl",
    "gtpo": "gtpo",
    "gtpo(scope=request)": {"outcome": {"name": "gtpo", "scope": "request"}},
    "gtpo(scope=request)+ktae+whiten": {
        "outcome": {"name": "gtpo", "scope": "request", "alpha2": 0.5},
        "ktae": {},
        "whiten": True,
    },
    "grpo_s": "grpo_s",
    "hicra": "hicra",
    "gtpo+ktae+hicra+forking+whiten": {
        "outcome": "gtpo",
        "ktae": {},
        "hicra": {},
        "forking": {"rho": 0.5},
        "whiten": True,
    },
    "grpo_s+cscr+hicra(alpha=0.5)+clip": {
        "outcome": "grpo_s",
        "cscr": {},
        "hicra": {"alpha": 0.5},
        "clip": 0.5,
    },
    "maxrl+opsd+hicra": {"outcome": "maxrl", "opsd": {}, "hicra": {}},
}


def with_teachers(request: dict[str, Any]) -> dict[str, Any]:
    """The request with pos/neg teacher log-probs (for CSCR), exact in float32."""
    for group in request["groups"]:
        for r in group["rollouts"]:
            n = len(r["tokens"])
            r["teacher_logprobs"] = {
                "pos": [-0.25 * (k % 3) for k in range(n)],
                "neg": [-0.5 * (k % 4) for k in range(n)],
            }
    return request


def requests_for(estimator: Any) -> list[dict[str, Any]]:
    """The hand-made request (a group of one, an empty rollout, tied entropies) and random ones
    with groups of one, empty rollouts and ties."""
    returns = oracle.diagnostic_fields(oracle.resolve_estimator(estimator))
    out = [with_teachers(token_request(estimator, returns))]
    rng = np.random.default_rng(17)
    for _ in range(6):
        out.append(
            oracle.random_request(
                rng,
                estimator=estimator,
                entropy=True,
                sum_pi_squared=True,
                logprobs=True,
                is_weights=bool(rng.integers(0, 2)),
                teachers=["pos", "neg"],
                group_size=(1, 6),
                empty_prob=0.2,
                return_fields=returns,
            )
        )
    return out


def flat_batch(request: dict[str, Any]) -> RolloutBatch:
    """The request's rollouts as a flat batch built by hand (not by the JSON builder)."""
    rollouts = [r for g in request["groups"] for r in g["rollouts"]]

    def cat(get: Any) -> np.ndarray:
        return np.array([v for r in rollouts for v in get(r)], dtype=np.float32)

    given = [
        f
        for f in ("logprobs", "entropy", "sum_pi_squared", "is_weights", "planning_mask")
        if f in rollouts[0]
    ]
    return RolloutBatch.from_flat(
        tokens=np.array([t for r in rollouts for t in r["tokens"]], dtype=np.int32),
        offsets=np.concatenate([[0], np.cumsum([len(r["tokens"]) for r in rollouts])]),
        group_ids=[g["id"] for g in request["groups"]],
        group_index=np.repeat(
            np.arange(len(request["groups"])), [len(g["rollouts"]) for g in request["groups"]]
        ),
        rewards=np.array([r["reward"] for r in rollouts], dtype=np.float32),
        teacher_logprobs={
            name: cat(lambda r, n=name: r["teacher_logprobs"][n]) for name in ("pos", "neg")
        },
        **{name: cat(lambda r, n=name: r[n]) for name in given},
    )


def oracle_flat(request: dict[str, Any], field: str) -> np.ndarray:
    reference = oracle.reference_compute(request)
    values = [np.atleast_1d(r[field]) for g in reference["groups"] for r in g["rollouts"]]
    return np.concatenate(values) if values else np.zeros(0)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_compute_batch_matches_the_oracle_alone_and_composed(name: str) -> None:
    estimator = ESTIMATORS[name]
    for request in requests_for(estimator):
        returns = request["return"]
        result = compute_batch(flat_batch(request), estimator, "cpu", diagnostics=returns)
        np.testing.assert_allclose(
            result.advantages.numpy(), oracle_flat(request, "advantages"), rtol=TOL, atol=TOL
        )
        np.testing.assert_allclose(
            result.scalars.numpy(), oracle_flat(request, "scalar"), rtol=TOL, atol=TOL
        )
        for field in returns:
            if field != "scalar":
                np.testing.assert_allclose(
                    result.diagnostics[field].numpy(),
                    oracle_flat(request, field),
                    rtol=TOL,
                    atol=TOL,
                    err_msg=field,
                )


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_json_api_gives_the_numbers_of_compute_batch(name: str) -> None:
    estimator = ESTIMATORS[name]
    request = requests_for(estimator)[1]
    nested = compute(json.loads(json.dumps(request)), device="cpu")
    flat = compute_batch(flat_batch(request), estimator, "cpu", diagnostics=request["return"])
    rollouts = [r for g in nested["groups"] for r in g["rollouts"]]
    for field, values in [("advantages", flat.advantages), *flat.diagnostics.items()]:
        joined = np.concatenate([r[field] for r in rollouts])
        np.testing.assert_array_equal(joined, values.numpy(), err_msg=field)
    np.testing.assert_array_equal([r["scalar"] for r in rollouts], flat.scalars.numpy())


def test_forking_mask_applies_after_whitening_and_clipping() -> None:
    """The kept tokens have exactly the advantage the estimator gives without the mask (its
    whitening and clipping over every token of the request), the others exactly 0."""
    base = {"outcome": "otb", "ktae": {}, "whiten": True, "clip": 0.75}
    request = token_request({**base, "forking": {"rho": 0.5}}, ["forking_mask"])
    masked = compute(request, device="cpu")
    plain = compute(token_request(base), device="cpu")
    for g_masked, g_plain in zip(masked["groups"], plain["groups"], strict=True):
        for r_masked, r_plain in zip(g_masked["rollouts"], g_plain["rollouts"], strict=True):
            keep = r_masked["forking_mask"] == 1.0
            np.testing.assert_array_equal(r_masked["advantages"][keep], r_plain["advantages"][keep])
            assert np.all(r_masked["advantages"][~keep] == 0.0)
    kept = np.concatenate([r["forking_mask"] for g in masked["groups"] for r in g["rollouts"]])
    # 9 tokens, tau = the median entropy 1.0 (ties at 0.5 and 2.0): 5 kept.
    assert kept.tolist() == [0, 1, 0, 1, 0, 1, 0, 1, 1]


def test_otb_scalar_is_the_rollouts_mean_token_advantage() -> None:
    out = compute(token_request("otb", ["scalar", "otb_baseline"]), device="cpu")
    g0, g1 = (g["rollouts"] for g in out["groups"])
    for rollout, reward in zip([*g0, *g1], [1.0, 0.0, 0.5, 1.0], strict=True):
        a = rollout["advantages"]
        np.testing.assert_allclose(a, reward - rollout["otb_baseline"], rtol=1e-6, atol=1e-7)
        expected = float(np.mean(a.astype(np.float64))) if a.size else 0.0
        assert rollout["scalar"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # A group of one has no baseline; the empty rollout has no tokens and scalar 0.
    assert np.all(g1[0]["otb_baseline"] == 0.0) and g1[0]["scalar"] == 1.0
    assert g0[2]["advantages"].size == 0 and g0[2]["scalar"] == 0.0
    # The unique longest rollout (4 tokens, the second longest 2) has no baseline past t = 2.
    assert np.all(g0[0]["otb_baseline"][2:] == 0.0) and np.all(g0[0]["otb_baseline"][:2] > 0)


def test_estimators_listing_names_the_inputs_each_needs() -> None:
    check_listing(estimator_listing())


def test_rounding_past_the_ranges_is_accepted() -> None:
    """Trainers' float rounding: an entropy a little below 0, a sum of squares a little above 1
    or below pi^2 are values the service takes as given."""
    request = token_request({"outcome": "otb", "forking": {}})
    first = request["groups"][0]["rollouts"][0]
    first["entropy"][2] = -1e-6
    first["sum_pi_squared"][2] = 1.0 + 5e-5
    first["sum_pi_squared"][0] = 0.5  # below pi^2 = exp(-0.5) = 0.607
    out = compute(request, device="cpu")
    assert np.all(np.isfinite(out["groups"][0]["rollouts"][0]["advantages"]))


@pytest.mark.parametrize("case", ERROR_CASES, ids=ERROR_IDS)
def test_request_errors_name_group_rollout_and_field(case: Any) -> None:
    with pytest.raises(RequestError) as info:
        compute(case.request(), device="cpu")
    err = info.value
    assert (err.code, err.group_id, err.rollout_index, err.field) == case.expected


@pytest.mark.parametrize("case", ERROR_CASES, ids=ERROR_IDS)
def test_cli_compute_prints_each_error_and_exits_1(
    case: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "request.json"
    source.write_text(json.dumps(case.request()))
    code = cli_main(["compute", "--input", str(source), "--output", str(tmp_path / "out.json")])
    assert code == 1
    error = json.loads(capsys.readouterr().err)["error"]
    assert (error["code"], error["group_id"], error["rollout_index"], error["field"]) == (
        case.expected
    )
    assert not (tmp_path / "out.json").exists()


def compute_in_a_process(request: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``python -m advantage_service compute`` given the request on stdin."""
    return subprocess.run(
        [sys.executable, "-m", "advantage_service", "compute", "--device", "cpu"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.integration
def test_cli_process_computes_otb_and_forking_and_refuses_a_missing_input(tmp_path: Any) -> None:
    estimator = {"outcome": "otb", "ktae": {}, "forking": {}}
    request = token_request(estimator, ["scalar", "forking_mask", "otb_baseline"])
    run = compute_in_a_process(request)
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    expected = compute(request, device="cpu")
    for g_cli, g_api in zip(printed["groups"], expected["groups"], strict=True):
        for r_cli, r_api in zip(g_cli["rollouts"], g_api["rollouts"], strict=True):
            for key, value in r_api.items():
                np.testing.assert_array_equal(np.asarray(r_cli[key], np.float32), value)

    del request["groups"][1]["rollouts"][0]["sum_pi_squared"]
    run = compute_in_a_process(request)
    assert run.returncode == 1 and run.stdout == ""
    error = json.loads(run.stderr)["error"]
    assert (error["code"], error["group_id"], error["rollout_index"], error["field"]) == (
        "missing_input",
        "g1",
        0,
        "sum_pi_squared",
    )


def test_token_inputs_travel_with_the_batch_to_another_device() -> None:
    batch = flat_batch(with_teachers(token_request()))
    moved = batch.to("meta")
    assert set(moved.token_inputs()) == {
        "logprobs",
        "entropy",
        "sum_pi_squared",
        "is_weights",
        "planning_mask",
    }
    assert all(v.device.type == "meta" for v in moved.token_inputs().values())
    assert moved.entropy is not None and moved.entropy.shape == batch.entropy.shape  # type: ignore[union-attr]
    assert torch.equal(batch.to("cpu").entropy, batch.entropy)  # type: ignore[arg-type]
