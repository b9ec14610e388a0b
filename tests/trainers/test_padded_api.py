"""compute_padded, in-process and over both clients, against the oracle on random padded
batches: left and right padding, holes in the mask, shuffled rows (a group's rows not adjacent),
string, integer and uuid group ids, empty rows, every preset, and the token-level methods with
their per-token inputs (entropy, sum_pi_squared, is_weights, planning_mask)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from advantage_client import GrpcClient, HttpClient
from advantage_contract.errors import AdvantageError
from advantage_contract.padded import PaddedLayout, needs_token_ids
from advantage_service import RequestError, compute_padded
from oracle import NONNEGATIVE_OUTCOME_NAMES, PRESETS, TOKEN_PRESETS
from padded_batches import ID_KINDS, LAYOUTS, assert_matches, call_kwargs, padded_case

PRESET_CASES = [(p, layout, ids) for p in PRESETS for layout, ids in [("mixed", "str")]]
# The methods over per-token inputs, alone and composed, and MaxRL.
TOKEN_METHODS: list[Any] = [*NONNEGATIVE_OUTCOME_NAMES, *TOKEN_PRESETS]
TOKEN_METHODS += [
    {"outcome": "gtpo", "ktae": {}, "hicra": {"alpha": 0.5}, "whiten": True},
    {"outcome": "grpo_s", "hicra": {}, "forking": {"rho": 0.5}},
    {"outcome": "maxrl", "hicra": {}, "clip": 1.0},
]
TOKEN_IDS = [
    m if isinstance(m, str) else "+".join(k for k in m if k != "whiten") for m in TOKEN_METHODS
]
LAYOUT_CASES = [(layout, ids) for layout in LAYOUTS for ids in ID_KINDS]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_process_matches_the_oracle_for_every_preset(preset: str, seed: int) -> None:
    case = padded_case(seed, preset, ignore_token_ids=[3] if seed == 2 else None)
    result = compute_padded(
        torch.from_numpy(case.tokens),
        torch.from_numpy(case.mask),
        torch.from_numpy(case.rewards),
        case.group_ids,
        **{
            k: ({n: torch.from_numpy(v) for n, v in v.items()} if isinstance(v, dict) else v)
            for k, v in call_kwargs(case).items()
        },
    )
    assert isinstance(result.advantages, torch.Tensor)
    assert_matches(case, result, f"{preset} seed {seed}")


@pytest.mark.parametrize("estimator", TOKEN_METHODS, ids=TOKEN_IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_in_process_matches_the_oracle_for_the_token_methods(estimator: Any, seed: int) -> None:
    case = padded_case(30 + seed, estimator, n_groups=(2, 4))
    for kind in ("numpy", "torch"):
        kwargs = call_kwargs(case)
        arrays = (case.tokens, case.mask, case.rewards)
        if kind == "torch":
            arrays = tuple(torch.from_numpy(a) for a in arrays)  # type: ignore[assignment]
            kwargs = {
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in kwargs.items()
            }
        result = compute_padded(*arrays, case.group_ids, **kwargs)
        assert_matches(case, result, f"{estimator} seed {seed} {kind}")


def test_a_boolean_planning_mask_is_a_0_1_mask() -> None:
    case = padded_case(7, "hicra")
    kwargs = call_kwargs(case)
    as_bool = np.where(case.mask, kwargs["planning_mask"] == 1.0, False)
    result = compute_padded(
        case.tokens,
        case.mask,
        case.rewards,
        case.group_ids,
        **(kwargs | {"planning_mask": as_bool}),
    )
    assert_matches(case, result, "hicra, bool mask")
    torch_result = compute_padded(
        torch.from_numpy(case.tokens),
        torch.from_numpy(case.mask),
        torch.from_numpy(case.rewards),
        case.group_ids,
        **(kwargs | {"planning_mask": torch.from_numpy(as_bool)}),
    )
    assert_matches(case, torch_result, "hicra, torch bool mask")


def test_maxrl_needs_no_token_ids_and_gtpo_needs_its_entropy() -> None:
    case = padded_case(8, "maxrl")
    result = compute_padded(None, case.mask, case.rewards, case.group_ids, estimator="maxrl")
    assert_matches(case, result, "maxrl without tokens")
    assert not needs_token_ids("maxrl")
    gtpo = padded_case(9, "gtpo")
    with pytest.raises(RequestError) as info:
        compute_padded(gtpo.tokens, gtpo.mask, gtpo.rewards, gtpo.group_ids, estimator="gtpo")
    assert (info.value.code, info.value.field) == ("missing_input", "entropy")


@pytest.mark.parametrize(("layout", "ids"), LAYOUT_CASES)
def test_in_process_any_padding_holes_and_id_kind(layout: str, ids: str) -> None:
    for preset in ("ktae", "rloo"):
        case = padded_case(11, preset, layout=layout, ids=ids, n_groups=(3, 5))
        result = compute_padded(
            case.tokens, case.mask, case.rewards, case.group_ids, **call_kwargs(case)
        )
        assert isinstance(result.advantages, np.ndarray)  # numpy in, numpy out
        assert_matches(case, result, f"{preset} {layout} {ids}")


def test_only_the_diagnostics_asked_for_are_returned() -> None:
    case = padded_case(3, "cscr")
    kwargs = call_kwargs(case) | {"diagnostics": ["sensitivity"]}
    result = compute_padded(case.tokens, case.mask, case.rewards, case.group_ids, **kwargs)
    assert list(result.diagnostics) == ["sensitivity"]
    result = compute_padded(
        case.tokens, case.mask, case.rewards, case.group_ids, **(kwargs | {"diagnostics": ()})
    )
    assert result.diagnostics == {}


def test_an_outcome_estimator_needs_no_token_ids() -> None:
    case = padded_case(4, "opo")
    result = compute_padded(None, case.mask, case.rewards, case.group_ids, estimator="opo")
    assert_matches(case, result, "opo without tokens")
    assert not needs_token_ids("opo") and not needs_token_ids({"outcome": "rloo", "ktae": None})
    assert needs_token_ids("ktae") and needs_token_ids({"outcome": "grpo", "cscr": {}})
    with pytest.raises(RequestError, match="needs the token ids"):
        compute_padded(None, case.mask, case.rewards, case.group_ids, estimator="ktae")


def test_bad_shapes_are_request_errors_naming_the_field() -> None:
    case = padded_case(5, "ktae")
    with pytest.raises(RequestError) as info:
        compute_padded(
            case.tokens[:, :-1], case.mask, case.rewards, case.group_ids, estimator="ktae"
        )
    assert info.value.field == "tokens"
    with pytest.raises(RequestError) as info:
        compute_padded(case.tokens, case.mask, case.rewards[:-1], case.group_ids)
    assert info.value.field == "rewards"
    with pytest.raises(RequestError) as info:
        compute_padded(case.tokens, case.mask, case.rewards, case.group_ids[:-1])
    assert info.value.field == "group_ids"


def test_layout_gathers_and_scatters_through_holes() -> None:
    mask = np.array([[0, 1, 0, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 1]], bool)
    values = np.arange(20).reshape(4, 5)
    layout = PaddedLayout.from_padded(mask, np.zeros(4), ["b", "a", "b", 7])
    flat = layout.gather(values, "tokens")
    assert flat.tolist() == [1, 3, 4, 5, 6, 18, 19]
    assert layout.offsets.tolist() == [0, 3, 5, 5, 7]
    assert layout.group_ids == ["7", "a", "b"] and layout.group_index.tolist() == [2, 1, 2, 0]
    back = layout.scatter(flat.astype(np.float32))
    np.testing.assert_array_equal(back, np.where(mask, values, 0))
    rows = layout.broadcast(np.array([1.0, 2.0, 3.0, 4.0]))
    np.testing.assert_array_equal(rows, mask * np.array([[1.0], [2.0], [3.0], [4.0]]))


# ---- over the clients: the same numbers through a real service ----------------------------------


@pytest.fixture(scope="module")
def clients(service):  # type: ignore[no-untyped-def]
    http = HttpClient(service.url)
    grpc_client = GrpcClient(service.target)
    yield {"http": http, "grpc": grpc_client}
    http.close()
    grpc_client.close()


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("preset", PRESETS)
def test_clients_match_the_oracle_for_every_preset(clients, transport: str, preset: str) -> None:  # type: ignore[no-untyped-def]
    case = padded_case(21, preset, ignore_token_ids=[2])
    result = clients[transport].compute_padded(
        torch.from_numpy(case.tokens),
        case.mask,
        case.rewards.tolist(),
        case.group_ids,
        **call_kwargs(case),
    )
    assert isinstance(result.advantages, np.ndarray)
    assert_matches(case, result, f"{transport} {preset}")


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("estimator", TOKEN_METHODS, ids=TOKEN_IDS)
def test_clients_match_the_oracle_for_the_token_methods(
    clients, transport: str, estimator: Any
) -> None:  # type: ignore[no-untyped-def]
    case = padded_case(40, estimator, n_groups=(2, 4))
    kwargs = call_kwargs(case)
    if "planning_mask" in kwargs:  # a trainer's bool mask travels as 0/1
        kwargs["planning_mask"] = np.where(case.mask, kwargs["planning_mask"] == 1.0, False)
    result = clients[transport].compute_padded(
        case.tokens, case.mask, case.rewards, case.group_ids, **kwargs
    )
    assert_matches(case, result, f"{transport} {estimator}")


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize(("layout", "ids"), LAYOUT_CASES)
def test_clients_any_padding_holes_and_id_kind(
    clients, transport: str, layout: str, ids: str
) -> None:  # type: ignore[no-untyped-def]
    case = padded_case(12, "ktae", layout=layout, ids=ids, n_groups=(3, 5))
    result = clients[transport].compute_padded(
        case.tokens, case.mask, case.rewards, case.group_ids, **call_kwargs(case)
    )
    assert_matches(case, result, f"{transport} {layout} {ids}")


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_clients_errors_are_the_services(clients, transport: str) -> None:  # type: ignore[no-untyped-def]
    case = padded_case(6, "grpo")
    rewards = case.rewards.copy()
    rewards[0] = np.nan
    with pytest.raises(AdvantageError) as info:
        clients[transport].compute_padded(case.tokens, case.mask, rewards, case.group_ids)
    assert info.value.field == "reward"
    with pytest.raises(AdvantageError) as info:
        clients[transport].compute_padded(case.tokens, case.mask, case.rewards, case.group_ids[:2])
    assert info.value.field == "group_ids"
