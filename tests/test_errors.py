"""Every error case of ESTIMATORS.md: the error names the group, the rollout and the field."""

from __future__ import annotations

import copy
import math

import numpy as np
import oracle
import pytest
from advantage_service import RequestError, RolloutBatch, compute
from advantage_service.batch import TOKEN_INPUTS


def base_request() -> dict:
    return {
        "estimator": "grpo",
        "groups": [
            {
                "id": "g0",
                "rollouts": [
                    oracle.rollout([1, 2], 1.0, [-0.1, -0.2], pos=[-0.1, -0.3], neg=[-0.5, -0.2]),
                    oracle.rollout([3], 0.0, [-0.3], pos=[-0.2], neg=[-0.1]),
                ],
            },
            {
                "id": "g1",
                "rollouts": [
                    oracle.rollout(
                        [4, 5, 6],
                        0.5,
                        [-1.0, -1.0, -1.0],
                        pos=[-0.1, -0.3, -0.2],
                        neg=[-0.5, -0.2, -0.9],
                    ),
                    oracle.rollout([], 0.0, [], pos=[], neg=[]),
                ],
            },
        ],
    }


def error_of(request: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        compute(request, device="cpu")
    return info.value


def where(err: RequestError) -> tuple:
    return err.code, err.group_id, err.rollout_index, err.field


def test_base_request_is_valid():
    out = compute(base_request(), device="cpu")
    assert [g["id"] for g in out["groups"]] == ["g0", "g1"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_names_group_rollout_and_field(value):
    req = base_request()
    req["groups"][1]["rollouts"][1]["reward"] = value
    assert where(error_of(req)) == ("invalid_value", "g1", 1, "reward")


@pytest.mark.parametrize("field", ["logprobs", "teacher_logprobs.pos", "teacher_logprobs.neg"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.5])
def test_bad_log_probability_names_its_array(field, value):
    req = base_request()
    rollout = req["groups"][1]["rollouts"][0]
    if field == "logprobs":
        rollout["logprobs"][2] = value
    else:
        rollout["teacher_logprobs"][field.split(".")[1]][2] = value
    err = error_of(req)
    assert where(err) == ("invalid_value", "g1", 0, field)
    assert "token 2" in err.message


def test_log_probability_just_above_zero_is_tolerated():
    req = base_request()
    req["groups"][0]["rollouts"][0]["logprobs"][0] = 5e-5
    compute(req, device="cpu")


@pytest.mark.parametrize("field", ["logprobs", "teacher_logprobs.neg"])
def test_per_token_array_of_wrong_length(field):
    req = base_request()
    rollout = req["groups"][0]["rollouts"][1]
    if field == "logprobs":
        rollout["logprobs"] = [-0.1, -0.2]
    else:
        rollout["teacher_logprobs"]["neg"] = []
    err = error_of(req)
    assert where(err) == ("length_mismatch", "g0", 1, field)


def test_negative_token_id():
    req = base_request()
    req["groups"][1]["rollouts"][0]["tokens"][1] = -7
    assert where(error_of(req)) == ("token_out_of_range", "g1", 0, "tokens")


def test_token_id_at_vocab_size():
    req = base_request()
    req["vocab_size"] = 6
    err = error_of(req)
    assert where(err) == ("token_out_of_range", "g1", 0, "tokens")
    assert "vocab_size 6" in err.message


def test_token_id_beyond_int32():
    req = base_request()
    req["groups"][0]["rollouts"][1]["tokens"] = [2**31]
    assert where(error_of(req)) == ("token_out_of_range", "g0", 1, "tokens")


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.int16])
@pytest.mark.parametrize(
    "source", ["writable", "read-only view", "bytes", "arrow", "mutable arrow buffer"]
)
def test_token_ids_of_every_integer_dtype_are_checked_and_only_immutable_ones_are_not_copied(
    dtype: type, source: str
) -> None:
    import pyarrow as pa

    def batch_of(ids: list[int]) -> tuple[np.ndarray, RolloutBatch]:
        tokens = np.array(ids, dtype=dtype)
        if source == "read-only view":  # (its base stays writable)
            tokens = tokens.view()
            tokens.flags.writeable = False
        elif source == "bytes":
            tokens = np.frombuffer(tokens.tobytes(), dtype=dtype)
        elif source == "arrow":
            tokens = pa.array(tokens).to_numpy(zero_copy_only=True)
        elif source == "mutable arrow buffer":  # (read-only here, writable through its buffer)
            buffer = pa.allocate_buffer(tokens.nbytes)
            np.frombuffer(buffer, dtype=dtype)[:] = tokens
            tokens = np.frombuffer(buffer, dtype=dtype)
            tokens.flags.writeable = False
        batch = RolloutBatch.from_flat(
            tokens=tokens,
            offsets=[0, 2, len(ids)],
            group_ids=["g"],
            group_index=[0, 0],
            rewards=[1.0, 0.0],
        )
        return tokens, batch

    tokens, batch = batch_of([7, 0, 3, 9])
    assert batch.tokens.dtype.is_signed and batch.tokens.element_size() == 4  # int32
    assert batch.tokens.tolist() == [7, 0, 3, 9]
    shared = batch.tokens.data_ptr() == tokens.ctypes.data
    # int32 ids nobody can write (a body's, as Arrow gives them) are used where they lie; any
    # other array is copied, so that a caller reusing its buffer cannot change what the
    # statistics written after the answer read.
    assert shared == (dtype is np.int32 and source in ("bytes", "arrow"))
    if np.iinfo(dtype).max >= 2**31:
        with pytest.raises(RequestError) as info:
            batch_of([7, 0, 2**31, 9])  # not wrapped around to a negative (or valid) id
        err = info.value
        assert (err.code, err.group_id, err.rollout_index, err.field) == (
            "token_out_of_range",
            "g",
            1,
            "tokens",
        )


def test_non_integer_token_id():
    req = base_request()
    req["groups"][0]["rollouts"][1]["tokens"] = [1.5]
    assert where(error_of(req)) == ("invalid_type", "g0", 1, "tokens")


def test_cscr_without_the_negative_condition():
    req = base_request()
    req["estimator"] = "cscr"
    for group in req["groups"]:
        for r in group["rollouts"]:
            del r["teacher_logprobs"]["neg"]
    err = error_of(req)
    assert err.code == "missing_input"
    assert err.field == "teacher_logprobs.neg"


def test_opsd_without_student_logprobs():
    req = base_request()
    req["estimator"] = "opsd"
    for group in req["groups"]:
        for r in group["rollouts"]:
            del r["logprobs"]
    err = error_of(req)
    assert (err.code, err.field) == ("missing_input", "logprobs")


def test_logprobs_on_some_rollouts_only():
    req = base_request()
    del req["groups"][1]["rollouts"][0]["logprobs"]
    assert where(error_of(req)) == ("missing_input", "g1", 0, "logprobs")


def test_unknown_estimator_name():
    req = base_request()
    req["estimator"] = "ppo"
    err = error_of(req)
    assert (err.code, err.field) == ("unknown_estimator", "estimator")
    assert "grpo" in err.message  # lists what exists


def test_unknown_outcome_in_object():
    req = base_request()
    req["estimator"] = {"outcome": {"name": "vanilla"}}
    assert (error_of(req).code, error_of(req).field) == (
        "unknown_estimator",
        "estimator.outcome.name",
    )


@pytest.mark.parametrize(
    ("estimator", "field"),
    [
        ({"outcome": {"name": "grpo", "norm": True}}, "estimator.outcome.norm"),
        ({"outcome": "rloo", "cscr": {"strenght": 0.1}}, "estimator.cscr.strenght"),
        ({"outcome": "grpo", "ktae": {"k1": 2}}, "estimator.ktae.k1"),
        ({"outcome": "grpo", "gae": {}}, "estimator.gae"),
    ],
)
def test_unknown_parameter(estimator, field):
    req = base_request()
    req["estimator"] = estimator
    err = error_of(req)
    assert (err.code, err.field) == ("unknown_parameter", field)


@pytest.mark.parametrize(
    ("estimator", "field"),
    [
        ({"cscr": {"strength": 1.5}}, "estimator.cscr.strength"),
        ({"cscr": {"strength": -0.1}}, "estimator.cscr.strength"),
        ({"cscr": {"decay": -1}}, "estimator.cscr.decay"),
        ({"ktae": {"tf_b": 2}}, "estimator.ktae.tf_b"),
        ({"ktae": {"tf_k1": 0}}, "estimator.ktae.tf_k1"),
        ({"ktae": {"history": "forever"}}, "estimator.ktae.history"),
        ({"ktae": {"fisher_weight": 0, "ig_weight": 0}}, "estimator.ktae.fisher_weight"),
        ({"opsd": {"clip": 0}}, "estimator.opsd.clip"),
        ({"clip": -1}, "estimator.clip"),
        ({"outcome": {"name": "grpo", "epsilon": -1}}, "estimator.outcome.epsilon"),
        ({"outcome": {"name": "grpo", "epsilon": math.inf}}, "estimator.outcome.epsilon"),
    ],
)
def test_parameter_out_of_range(estimator, field):
    req = base_request()
    req["estimator"] = estimator
    err = error_of(req)
    assert err.code == "out_of_range"
    assert err.field == field


@pytest.mark.parametrize(
    ("estimator", "field"),
    [
        ({"whiten": "yes"}, "estimator.whiten"),
        ({"ktae": {"tf": 1}}, "estimator.ktae.tf"),
        ({"cscr": {"onset": "0.1"}}, "estimator.cscr.onset"),
        ({"ktae": {"scale": True}}, "estimator.ktae.scale"),
    ],
)
def test_parameter_of_wrong_type(estimator, field):
    req = base_request()
    req["estimator"] = estimator
    err = error_of(req)
    assert (err.code, err.field) == ("invalid_parameter", field)


def test_duplicate_group_id():
    req = base_request()
    req["groups"][1]["id"] = "g0"
    err = error_of(req)
    assert (err.code, err.group_id) == ("duplicate_group", "g0")


def test_grpo_passk_with_a_group_of_one():
    req = base_request()
    req["estimator"] = "grpo_passk"
    req["groups"][1]["rollouts"] = req["groups"][1]["rollouts"][:1]
    err = error_of(req)
    assert (err.code, err.group_id, err.field) == ("group_too_small", "g1", "rollouts")


def test_diagnostic_whose_term_is_off():
    req = base_request()
    req["return"] = ["scalar", "ktae_score"]
    err = error_of(req)
    assert (err.code, err.field) == ("invalid_parameter", "return")
    assert "ktae_score" in err.message


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda r: r.update(groups="nope"), ("invalid_type", None, None, "groups")),
        (lambda r: r.update(colour="red"), ("unknown_field", None, None, "colour")),
        (lambda r: r["groups"][0].update(id=7), ("invalid_type", None, None, "id")),
        (lambda r: r["groups"][0].update(rollouts=[]), ("invalid_type", "g0", None, "rollouts")),
        (
            lambda r: r["groups"][1]["rollouts"][0].pop("reward"),
            ("invalid_type", "g1", 0, "reward"),
        ),
        (
            lambda r: r["groups"][1]["rollouts"][0].update(reward="1"),
            ("invalid_type", "g1", 0, "reward"),
        ),
        (
            lambda r: r["groups"][1]["rollouts"][0].update(reward=True),
            ("invalid_type", "g1", 0, "reward"),
        ),
        (
            lambda r: r["groups"][1]["rollouts"][1].update(tokens=None),
            ("invalid_type", "g1", 1, "tokens"),
        ),
        (  # ragged nesting: numpy cannot convert it (a request error, not a crash)
            lambda r: r["groups"][1]["rollouts"][0]["tokens"].__setitem__(1, [5]),
            ("invalid_type", "g1", 0, "tokens"),
        ),
        (
            lambda r: r["groups"][1]["rollouts"][1].update(logprob=[]),
            ("unknown_field", "g1", 1, "logprob"),
        ),
        (
            lambda r: r["groups"][0]["rollouts"][1].update(logprobs=["x"]),
            ("invalid_type", "g0", 1, "logprobs"),
        ),
        (lambda r: r.update(vocab_size=0), ("invalid_type", None, None, "vocab_size")),
        (lambda r: r.update(namespace=""), ("invalid_type", None, None, "namespace")),
        (
            lambda r: r.update(ignore_token_ids=["a"]),
            ("invalid_type", None, None, "ignore_token_ids"),
        ),
    ],
)
def test_malformed_request_shapes(mutate, expected):
    req = copy.deepcopy(base_request())
    mutate(req)
    assert where(error_of(req)) == expected


def test_request_must_be_an_object():
    with pytest.raises(RequestError) as info:
        compute([1, 2], device="cpu")  # type: ignore[arg-type]
    assert info.value.code == "invalid_type"


def test_flat_batch_errors_name_the_rollout_in_its_group():
    # Groups interleaved in the flat layout: rollout 3 is the second rollout of group "b".
    with pytest.raises(RequestError) as info:
        RolloutBatch.from_flat(
            tokens=np.array([1, 2, 3, 4]),
            offsets=np.array([0, 1, 2, 3, 4]),
            group_ids=["a", "b"],
            group_index=np.array([0, 1, 0, 1]),
            rewards=np.array([1.0, 0.0, 1.0, np.nan]),
        )
    assert where(info.value) == ("invalid_value", "b", 1, "reward")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"offsets": np.array([0, 1, 2])}, "offsets"),
        ({"offsets": np.array([0, 3, 2, 4, 4])}, "offsets"),
        ({"group_index": np.array([0, 1, 2, 1])}, "group_index"),
        ({"rewards": np.array([1.0, 0.0])}, "offsets"),
        ({"tokens": np.array([1.0, 2.0, 3.0, 4.0])}, "tokens"),
        ({"logprobs": np.array([-1.0, -1.0])}, "logprobs"),
        # (each per-token input by its keyword, checked and named as logprobs is)
        *[({name: np.array([0.5, 0.5])}, name) for name in TOKEN_INPUTS if name != "logprobs"],
    ],
)
def test_flat_batch_shape_errors(kwargs, field):
    args = {
        "tokens": np.array([1, 2, 3, 4]),
        "offsets": np.array([0, 1, 2, 3, 4]),
        "group_ids": ["a", "b"],
        "group_index": np.array([0, 1, 0, 1]),
        "rewards": np.array([1.0, 0.0, 1.0, 0.0]),
    }
    args.update(kwargs)
    with pytest.raises(RequestError) as info:
        RolloutBatch.from_flat(**args)
    assert info.value.field == field


def test_grpo_with_epsilon_zero_gives_zero_for_a_group_of_equal_rewards():
    req = base_request()
    req["estimator"] = {"outcome": {"name": "grpo", "epsilon": 0}}
    for r in req["groups"][0]["rollouts"]:
        r["reward"] = 0.5
    out = compute(req, device="cpu")
    for r in out["groups"][0]["rollouts"]:
        assert np.all(r["advantages"] == 0)
    assert np.all(np.isfinite(out["groups"][1]["rollouts"][0]["advantages"]))


def test_clip_beyond_float32_range_clips_nothing():
    req = base_request()
    plain = compute(req, device="cpu")
    req["estimator"] = {"outcome": "grpo", "clip": 1e308}
    clipped = compute(req, device="cpu")
    for g1, g2 in zip(plain["groups"], clipped["groups"], strict=True):
        for r1, r2 in zip(g1["rollouts"], g2["rollouts"], strict=True):
            np.testing.assert_array_equal(r1["advantages"], r2["advantages"])


@pytest.mark.parametrize(
    ("request_obj", "code", "status", "field", "where"),
    [
        # a boolean is not a token id (numpy would read true as 1)
        ({"tokens": [1, True]}, "invalid_type", 422, "tokens", ("g", 0)),
        # a finite reward past float32's range is named as such, not as "inf"
        ({"tokens": [1], "reward": 1e300}, "invalid_value", 422, "reward", ("g", 0)),
        # an id past int64 keeps its value in the message and names its rollout
        ({"tokens": [5, 2**63]}, "token_out_of_range", 422, "tokens", ("g", 0)),
    ],
)
def test_reproducers_of_odd_values_are_located_request_errors(
    request_obj: dict, code: str, status: int, field: str, where: tuple
) -> None:
    from advantage_service import RequestError, compute

    rollout = {"reward": 1.0, **request_obj}
    with pytest.raises(RequestError) as info:
        compute({"groups": [{"id": "g", "rollouts": [rollout]}]})
    error = info.value
    assert (error.code, error.status, error.field) == (code, status, field)
    assert (error.group_id, error.rollout_index) == where
    if code == "invalid_value":
        assert "1e+300" in error.message and "inf" not in error.message
    if code == "token_out_of_range":
        assert str(2**63) in error.message


def test_identifiers_are_bounded_and_not_echoed() -> None:
    from advantage_service import RequestError, compute

    small = {"id": "g", "rollouts": [{"tokens": [1], "reward": 1.0}]}
    for request_obj, field in (
        ({"request_id": "r" * 257, "groups": [small]}, "request_id"),
        ({"groups": [{**small, "id": "g" * 257}]}, "id"),
        (
            {
                "groups": [
                    {
                        "id": "g",
                        "rollouts": [
                            {"tokens": [1], "reward": 1.0, "teacher_logprobs": {"c" * 65: [-1.0]}}
                        ],
                    }
                ]
            },
            "teacher_logprobs",
        ),
    ):
        with pytest.raises(RequestError) as info:
            compute(request_obj)
        error = info.value
        assert (error.code, error.status, error.field) == ("limit_exceeded", 413, field)
        assert len(error.message) < 200 and (error.group_id or "") != "g" * 257
    # At the limits they pass.
    compute({"request_id": "r" * 256, "groups": [{**small, "id": "g" * 256}]})
