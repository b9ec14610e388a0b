"""The token-level methods (forking tokens, OTB, GTPO, GRPO-S, HICRA; MaxRL beside them) over
gRPC against a real service: entropy, sum_pi_squared, is_weights and planning_mask as raw tensors
(unary and stream) give the numbers of HTTP and in-process, every request error they add is
located as over HTTP (group, rollout, field), on unary calls and on streams; and a service with
a tokenizer finds HICRA's planning tokens itself, the same on every transport."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from advantage_client.grpc_client import compute_request_message
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service import compute as compute_in_process
from advantage_service.estimators.hicra import strategic_phrase_mask
from grpc_support import diagnostics_for, random_request, stream_rollouts
from service_support import Service
from token_cases import ERROR_CASES, ERROR_IDS, token_request

pytestmark = pytest.mark.integration

ESTIMATORS = [
    "otb",
    "forking",
    {"outcome": "otb", "ktae": {}},
    {"outcome": "rloo", "cscr": {}, "forking": {"scope": "group"}},
    "maxrl",
    "gtpo",
    "grpo_s",
    "hicra",
    {"outcome": "gtpo", "cscr": {}, "hicra": {"alpha": 0.5}, "whiten": True},
    {"outcome": "maxrl", "ktae": {}, "hicra": {}, "forking": {"rho": 0.5}},
]
IDS = ["otb", "forking", "otb+ktae", "rloo+cscr+forking(group)", "maxrl", "gtpo", "grpo_s"]
IDS += ["hicra", "gtpo+cscr+hicra+whiten", "maxrl+ktae+hicra+forking"]


def flat(response: dict[str, Any], key: str) -> np.ndarray:
    return np.concatenate(
        [
            np.atleast_1d(np.asarray(r[key], np.float32))
            for g in response["groups"]
            for r in g["rollouts"]
        ]
    )


@pytest.mark.parametrize("index", range(len(ESTIMATORS)), ids=IDS)
def test_unary_token_methods_equal_http_and_in_process(service: Service, index: int) -> None:
    estimator = ESTIMATORS[index]
    request = random_request(seed=20 + index, estimator=estimator)
    via_grpc = GrpcClient(service.target).compute(request)
    via_arrow = HttpClient(service.url).compute(request)
    in_process = compute_in_process(request, device="cpu")
    assert via_grpc["estimator"] == in_process["estimator"]
    for key in ["advantages", *request["return"]]:
        np.testing.assert_array_equal(flat(via_grpc, key), flat(via_arrow, key), err_msg=key)
        np.testing.assert_allclose(
            flat(via_grpc, key), flat(in_process, key), rtol=1e-6, atol=1e-6, err_msg=key
        )


@pytest.mark.parametrize(
    "estimator",
    [
        {"outcome": "otb", "forking": {"rho": 0.5}},
        {"outcome": "gtpo", "hicra": {}},
        {"outcome": "grpo_s", "hicra": {"alpha": 0.5}, "forking": {"rho": 0.5}},
    ],
    ids=["otb+forking", "gtpo+hicra", "grpo_s+hicra+forking"],
)
def test_stream_carries_the_token_inputs_and_computes_each_group_alone(
    service: Service, estimator: dict[str, Any]
) -> None:
    request = random_request(seed=5, estimator=estimator)
    rollouts = stream_rollouts(request["groups"])
    random.Random(5).shuffle(rollouts)
    returns = diagnostics_for(estimator)
    results = list(
        GrpcClient(service.target).stream(rollouts, estimator=estimator, returns=returns)
    )
    assert sorted(r["id"] for r in results) == sorted(g["id"] for g in request["groups"])
    for result in results:
        group = next(g for g in request["groups"] if g["id"] == result["id"])
        # Rollouts in arrival order: the group alone, in that order (scope request = the group).
        order = [int(r["rollout_id"].rsplit("/", 1)[1]) for r in result["rollouts"]]
        alone = compute_in_process(
            {
                "estimator": estimator,
                "return": returns,
                "groups": [{"id": group["id"], "rollouts": [group["rollouts"][i] for i in order]}],
            },
            device="cpu",
        )["groups"][0]
        for got, want in zip(result["rollouts"], alone["rollouts"], strict=True):
            for key in ("advantages", *returns[1:]):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6)
            assert got["scalar"] == pytest.approx(want["scalar"], rel=1e-6, abs=1e-6)


def located(error: dict[str, Any] | AdvantageError) -> tuple[Any, ...]:
    if isinstance(error, AdvantageError):
        return error.code, error.group_id, error.rollout_index, error.field
    return error["code"], error["group_id"], error["rollout_index"], error["field"]


@pytest.mark.parametrize("case", ERROR_CASES, ids=ERROR_IDS)
def test_unary_errors_are_located_as_over_http(service: Service, case: Any) -> None:
    """What the flat message cannot carry (values on some rollouts only, one rollout's values
    of the wrong length) the client refuses before sending, with the service's error; the
    rest the service refuses with INVALID_ARGUMENT and the error's location in metadata."""
    request = case.request()
    # (NaN and infinity are JSON Python reads, which httpx's json= refuses to write)
    http = service.http.post(
        "/v1/advantages",
        content=json.dumps(request),
        headers={"content-type": "application/json"},
    )
    assert http.status_code == 422
    assert located(http.json()["error"]) == case.expected
    try:
        message = compute_request_message(request)
    except AdvantageError as exc:
        assert located(exc) == case.expected
        assert exc.message == http.json()["error"]["message"]
        return
    with grpc.insecure_channel(service.target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.AdvantageServiceStub(channel).Compute(message, timeout=30)
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error.details() == http.json()["error"]["message"]  # type: ignore[attr-defined]
    meta = dict(error.trailing_metadata())  # type: ignore[attr-defined]
    code, group_id, rollout_index, field = case.expected
    assert meta["advantage-error-code"] == code
    assert meta.get("advantage-group-id-bin", b"").decode() == (group_id or "")
    assert meta.get("advantage-rollout-index") == (
        None if rollout_index is None else str(rollout_index)
    )
    assert meta["advantage-field-bin"].decode() == field


def test_unary_flat_array_of_the_wrong_length_is_refused_by_the_service(service: Service) -> None:
    message = compute_request_message(token_request("forking"))
    entropy = np.frombuffer(message.entropy.data, "<f4")[:-1]
    message.entropy.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, data=entropy.tobytes()))
    with grpc.insecure_channel(service.target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.AdvantageServiceStub(channel).Compute(message, timeout=30)
    meta = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
    assert meta["advantage-error-code"] == "length_mismatch"
    assert meta["advantage-field-bin"] == b"entropy"


ROLLOUT_CASES = [c for c in ERROR_CASES if c.expected[1] is not None]


@pytest.mark.parametrize("case", ROLLOUT_CASES, ids=[c.name for c in ROLLOUT_CASES])
def test_stream_answers_a_bad_rollout_with_its_group_error(service: Service, case: Any) -> None:
    request = case.request()
    results = list(
        GrpcClient(service.target).stream(
            stream_rollouts(request["groups"]), estimator=case.estimator, returns=["scalar"]
        )
    )
    group_id = case.expected[1]
    errors = [r for r in results if "error" in r]
    assert [r["id"] for r in errors] == [group_id]
    assert located(errors[0]["error"]) == case.expected
    # The other group is computed as usual.
    assert [r["id"] for r in results if "error" not in r] == [
        g["id"] for g in request["groups"] if g["id"] != group_id
    ]


MISSING_CASES = [c for c in ERROR_CASES if c.expected[0] == "missing_input" and not c.expected[1]]


@pytest.mark.parametrize("case", MISSING_CASES, ids=[c.name for c in MISSING_CASES])
def test_stream_missing_input_is_an_error_of_every_group(service: Service, case: Any) -> None:
    request = case.request()
    results = list(
        GrpcClient(service.target).stream(
            stream_rollouts(request["groups"]), estimator=case.estimator
        )
    )
    assert sorted(r["id"] for r in results) == ["g0", "g1"]
    for result in results:
        assert result["error"]["code"] == case.expected[0] == "missing_input"
        assert result["error"]["field"] == case.expected[3]


def test_list_estimators_names_the_inputs(service: Service) -> None:
    listing = GrpcClient(service.target).list_estimators()
    outcomes = {o["name"]: o for o in listing["outcomes"]}
    terms = {t["name"]: t for t in listing["terms"]}
    assert outcomes["otb"]["inputs"] == ["logprobs", "sum_pi_squared"]
    assert outcomes["otb"]["optional_inputs"] == ["is_weights", "returns"]
    assert terms["forking"]["inputs"] == ["entropy"]
    assert {"otb", "forking"} <= set(listing["presets"])
    assert outcomes["gtpo"]["inputs"] == outcomes["grpo_s"]["inputs"] == ["entropy"]
    assert terms["hicra"]["inputs"] == ["planning_mask"]
    assert {"maxrl", "gtpo", "grpo_s", "hicra"} <= set(listing["presets"])
    assert listing == service.http.get("/v1/estimators").json()


# ---- HICRA's planning tokens from the service's tokenizer ---------------------------------------

# A word-level vocabulary (id i decodes to WORDS[i]) for a tokenizer.json the service loads.
WORDS = ["<unk>", "So", "wait", ",", "let", "me", "check", "the", "sum", "x", "=", "4", "Hmm"]
ID = {w: i for i, w in enumerate(WORDS)}


@pytest.fixture(scope="module")
def tokenizer_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    directory = tmp_path_factory.mktemp("tokenizer-service")
    path = directory / "tokenizer.json"
    Tokenizer(WordLevel(ID, unk_token="<unk>")).save(str(path))
    srv = Service.start(directory, tokenizer=str(path))
    yield srv
    srv.stop()


def sentences_request(estimator: Any) -> dict[str, Any]:
    """Two groups whose rollouts hold the paper's grams ("so", "wait", "let me", "hmm,")."""
    texts = [
        [("So wait , let me check the sum", 1.0), ("x = 4", 0.0), ("Hmm , x = 4", 0.0)],
        [("the sum = 4 , wait", 1.0), ("", 0.0), ("let me check x", 1.0)],
    ]
    return {
        "estimator": estimator,
        "return": diagnostics_for(estimator),
        "groups": [
            {
                "id": f"g{g}",
                "rollouts": [
                    {
                        "tokens": [ID[w] for w in text.split()],
                        "reward": reward,
                        "entropy": [0.25 * (k % 5) for k in range(len(text.split()))],
                    }
                    for text, reward in group
                ],
            }
            for g, group in enumerate(texts)
        ],
    }


def expected_mask(request: dict[str, Any], phrases: list[str] | None = None) -> list[float]:
    rollouts = [r for g in request["groups"] for r in g["rollouts"]]
    tokens = np.array([t for r in rollouts for t in r["tokens"]], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r["tokens"]) for r in rollouts])])
    args = () if phrases is None else (phrases,)
    return strategic_phrase_mask(tokens, offsets, WORDS, *args).tolist()


@pytest.mark.parametrize(
    "estimator",
    [
        "hicra",
        {"outcome": "gtpo", "hicra": {"alpha": 0.5}},
        {"outcome": "maxrl", "hicra": {"phrases": ["the sum", "x = 4"]}},
    ],
    ids=["hicra", "gtpo+hicra", "maxrl+hicra(phrases)"],
)
def test_a_service_with_a_tokenizer_finds_planning_tokens_on_every_transport(
    tokenizer_service: Service, estimator: Any
) -> None:
    request = sentences_request(estimator)
    phrases = estimator["hicra"].get("phrases") if isinstance(estimator, dict) else None
    mask = expected_mask(request, phrases)
    assert 0 < sum(mask) < len(mask)
    # The numbers of the same request with that mask given, computed in this process.
    given = json.loads(json.dumps(request))
    start = 0
    for group in given["groups"]:
        for r in group["rollouts"]:
            r["planning_mask"] = mask[start : start + len(r["tokens"])]
            start += len(r["tokens"])
    want = compute_in_process(given, device="cpu")

    via_json = tokenizer_service.http.post("/v1/advantages", json=request)
    assert via_json.status_code == 200, via_json.text
    via_arrow = HttpClient(tokenizer_service.url).compute(request)
    via_grpc = GrpcClient(tokenizer_service.target).compute(request)
    for response in (via_json.json(), via_arrow, via_grpc):
        np.testing.assert_array_equal(flat(response, "planning_mask"), np.float32(mask))
        for key in ["advantages", *request["return"]]:
            np.testing.assert_allclose(flat(response, key), flat(want, key), rtol=1e-6, atol=1e-6)

    results = list(
        GrpcClient(tokenizer_service.target).stream(
            stream_rollouts(request["groups"]), estimator=estimator, returns=request["return"]
        )
    )
    assert sorted(r["id"] for r in results) == ["g0", "g1"]
    for result in sorted(results, key=lambda r: r["id"]):
        group = next(g for g in given["groups"] if g["id"] == result["id"])
        alone = compute_in_process(
            {"estimator": estimator, "return": request["return"], "groups": [group]},
            device="cpu",
        )["groups"][0]
        for got, exp in zip(result["rollouts"], alone["rollouts"], strict=True):
            np.testing.assert_array_equal(got["planning_mask"], exp["planning_mask"])
            np.testing.assert_allclose(got["advantages"], exp["advantages"], rtol=1e-6, atol=1e-6)


def test_a_given_planning_mask_wins_over_the_tokenizer(tokenizer_service: Service) -> None:
    request = sentences_request("hicra")
    for group in request["groups"]:
        for r in group["rollouts"]:
            r["planning_mask"] = [1.0] * len(r["tokens"])
    got = GrpcClient(tokenizer_service.target).compute(request)
    assert np.all(flat(got, "planning_mask") == 1.0)


def test_the_viewer_still_reads_the_tokenizer(tokenizer_service: Service) -> None:
    response = tokenizer_service.http.post("/viewer/api/token-text", json={"ids": [2, 6]})
    assert response.status_code == 200, response.text
    assert response.json()["texts"] == {"2": "wait", "6": "check"}


def test_without_a_tokenizer_the_error_names_planning_mask_and_the_way_out(
    service: Service,
) -> None:
    response = service.http.post("/v1/advantages", json=sentences_request("hicra"))
    assert response.status_code == 422
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("missing_input", "planning_mask")
    assert "--tokenizer" in error["message"]
