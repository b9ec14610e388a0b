"""The three in-process entry points agree: compute(), compute_batch() and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from advantage_service import RolloutBatch, compute, compute_batch
from advantage_service.estimators import ktae_tables, resolve_estimator
from advantage_service.estimators.pipeline import estimator_diagnostics
from oracle import PRESETS, random_request


def run_cli(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "advantage_service", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.integration
def test_cli_and_python_api_give_identical_numbers_for_every_preset(tmp_path):
    rng = np.random.default_rng(7)
    requests = [random_request(rng, estimator=p, n_groups=(2, 3)) for p in PRESETS]
    # One process for all presets: a JSON-lines file would be another contract, so call the CLI
    # once per request file but through one interpreter start each (11 starts, a few seconds).
    for preset, req in zip(PRESETS, requests, strict=True):
        req["request_id"] = f"r-{preset}"
        src = tmp_path / f"{preset}.json"
        dst = tmp_path / f"{preset}.out.json"
        src.write_text(json.dumps(req))
        proc = run_cli(
            ["compute", "--input", str(src), "--output", str(dst), "--device", "cpu"], ""
        )
        assert proc.returncode == 0, proc.stderr
        via_cli = json.loads(dst.read_text())
        in_process = compute(req, device="cpu")
        assert via_cli["estimator"] == in_process["estimator"]
        assert via_cli["request_id"] == in_process["request_id"] == f"r-{preset}"
        for g_cli, g_api in zip(via_cli["groups"], in_process["groups"], strict=True):
            for r_cli, r_api in zip(g_cli["rollouts"], g_api["rollouts"], strict=True):
                assert set(r_cli) == set(r_api)
                for key, value in r_api.items():
                    # float32 -> JSON -> float32 round-trips exactly.
                    np.testing.assert_array_equal(
                        np.asarray(r_cli[key], dtype=np.float32),
                        np.asarray(value),
                        err_msg=f"{preset} group {g_api['id']} {key}",
                    )


@pytest.mark.integration
def test_cli_writes_the_json_the_http_service_answers_byte_for_byte():
    """One float formatting for the JSON contract: the CLI's output is the HTTP answer's text
    (float32 values in their shortest float32 repr, 1e-6 not 1e-06), compute times aside."""
    import asyncio
    import re

    import httpx
    from advantage_service.config import Settings
    from advantage_service.serving.engine import Engine
    from advantage_service.transports.http import create_app

    req = random_request(np.random.default_rng(3), estimator="ktae", n_groups=(3, 3))
    req["request_id"] = "same"
    proc = run_cli(["compute", "--device", "cpu"], json.dumps(req))
    assert proc.returncode == 0, proc.stderr

    async def post() -> str:
        engine = Engine(Settings(device="cpu"))
        engine.warm_up()
        transport = httpx.ASGITransport(app=create_app(engine.settings, engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            answer = await client.post("/v1/advantages", json=req)
        engine.close()
        return answer.text

    via_http = asyncio.run(post())

    def without_times(text: str) -> str:
        text = re.sub(r'"compute_ms":[0-9.e+-]+', '"compute_ms":0', text.strip())
        # The service records the request's statistics; the CLI, in-process, records nothing.
        return re.sub(r'"recorded":(true|null)', '"recorded":-', text)

    assert '"recorded":null' in proc.stdout and '"recorded":true' in via_http
    assert without_times(proc.stdout) == without_times(via_http)
    assert '"epsilon":1e-6' in proc.stdout
    # Every float in it is a float32 value's shortest repr (at most 9 significant digits).
    numbers = re.findall(r"-?\d+\.\d+(?:e-?\d+)?", proc.stdout.split('"summary"')[0])
    assert numbers and all(len(n.lstrip("-").replace(".", "").split("e")[0]) <= 10 for n in numbers)


@pytest.mark.integration
def test_cli_reads_stdin_and_writes_stdout():
    req = random_request(np.random.default_rng(1), estimator="ktae")
    proc = run_cli(["compute", "--device", "cpu"], json.dumps(req))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["summary"]["rollouts"] == sum(len(g["rollouts"]) for g in req["groups"])


@pytest.mark.integration
def test_cli_bad_request_prints_the_error_and_exits_non_zero():
    req = {
        "groups": [
            {"id": "p1", "rollouts": [{"tokens": [1, 2], "reward": 1.0, "logprobs": [-0.1]}]}
        ]
    }
    proc = run_cli(["compute", "--device", "cpu"], json.dumps(req))
    assert proc.returncode != 0
    err = json.loads(proc.stderr)["error"]
    assert err == {
        "code": "length_mismatch",
        "message": err["message"],
        "group_id": "p1",
        "rollout_index": 0,
        "field": "logprobs",
    }
    assert proc.stdout == ""


@pytest.mark.integration
def test_cli_malformed_json_is_a_request_error():
    proc = run_cli(["compute"], "{not json")
    assert proc.returncode != 0
    assert json.loads(proc.stderr)["error"]["code"] == "invalid_json"


def flat_from_request(req: dict) -> RolloutBatch:
    groups = req["groups"]
    rollouts = [r for g in groups for r in g["rollouts"]]
    lengths = [len(r["tokens"]) for r in rollouts]
    cat = lambda key: np.array([x for r in rollouts for x in r[key]])  # noqa: E731
    teachers = rollouts[0].get("teacher_logprobs") or {}
    return RolloutBatch.from_flat(
        tokens=cat("tokens").astype(np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        group_ids=[g["id"] for g in groups],
        group_index=np.repeat(np.arange(len(groups)), [len(g["rollouts"]) for g in groups]),
        rewards=np.array([r["reward"] for r in rollouts], dtype=np.float32),
        logprobs=cat("logprobs").astype(np.float32) if "logprobs" in rollouts[0] else None,
        teacher_logprobs={
            k: np.array([x for r in rollouts for x in r["teacher_logprobs"][k]], dtype=np.float32)
            for k in teachers
        },
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_compute_batch_equals_compute(preset):
    req = random_request(np.random.default_rng(3), estimator=preset, n_groups=(3, 4))
    nested = compute(req, device="cpu")
    flat = compute_batch(flat_from_request(req), preset, "cpu")
    expected = (
        np.concatenate([r["advantages"] for g in nested["groups"] for r in g["rollouts"]])
        if nested["groups"]
        else np.zeros(0)
    )
    np.testing.assert_array_equal(flat.advantages.numpy(), expected)
    assert flat.advantages.dtype == torch.float32
    assert flat.scalars.dtype == torch.float32


@pytest.mark.parametrize(
    "estimator",
    ["ktae", "cscr", {"outcome": "rloo", "ktae": {"tf": False}, "cscr": {}, "opsd": {}}],
    ids=["ktae", "cscr", "rloo_ktae_cscr_opsd"],
)
def test_compute_batch_returns_no_diagnostics_unless_asked_with_the_same_numbers(estimator):
    # As the server computes only what `return` asks for, so does the library: the default is
    # none, a name or a list asks for those alone, "all" for every one the estimator makes.
    spec = resolve_estimator(estimator)
    req = random_request(
        np.random.default_rng(21),
        estimator=estimator,
        n_groups=(3, 4),
        logprobs=True,
        teachers=["pos", "neg"],
    )
    batch = flat_from_request(req)
    plain = compute_batch(batch, estimator, "cpu")
    assert plain.diagnostics == {}
    every = compute_batch(batch, estimator, "cpu", diagnostics="all")
    produced = set(estimator_diagnostics(spec)) - {"scalar"}
    assert set(every.diagnostics) == produced and produced
    first = sorted(produced)[0]
    one = compute_batch(batch, estimator, "cpu", diagnostics=first)
    assert set(one.diagnostics) == {first}
    torch.testing.assert_close(one.diagnostics[first], every.diagnostics[first], rtol=0, atol=0)
    for other in (every, one):
        assert torch.equal(other.advantages, plain.advantages)
        assert torch.equal(other.scalars, plain.scalars)
    if "ktae_score" in produced:
        # The score is the bonus the advantages were built from: A = a_i + kt (no weights here).
        kt = every.diagnostics["ktae_score"]
        if "cscr_weight" not in produced and "opsd_reward" not in produced:
            a_i = plain.scalars[batch.rollout_of_token]
            torch.testing.assert_close(plain.advantages, a_i + kt, rtol=0, atol=1e-6)


def test_compute_takes_numpy_arrays_inside_the_groups_with_the_numbers_of_lists():
    # One builder for every caller: the clients' numpy arrays are what JSON lists are.
    req = random_request(np.random.default_rng(5), estimator="cscr", n_groups=(3, 4), logprobs=True)
    as_arrays = {
        **req,
        "groups": [
            {
                "id": g["id"],
                "rollouts": [
                    {
                        "tokens": np.array(r["tokens"], dtype=np.int32),
                        "reward": np.float32(r["reward"]),
                        "logprobs": np.array(r["logprobs"], dtype=np.float32),
                        "teacher_logprobs": {
                            k: np.array(v, dtype=np.float32)
                            for k, v in r["teacher_logprobs"].items()
                        },
                    }
                    for r in g["rollouts"]
                ],
            }
            for g in req["groups"]
        ],
    }
    lists, arrays = compute(req, device="cpu"), compute(as_arrays, device="cpu")
    for g1, g2 in zip(lists["groups"], arrays["groups"], strict=True):
        for r1, r2 in zip(g1["rollouts"], g2["rollouts"], strict=True):
            np.testing.assert_array_equal(r1["advantages"], r2["advantages"])


def test_ktae_densifies_token_ids_when_the_packed_key_would_overflow(monkeypatch):
    req = random_request(np.random.default_rng(11), estimator="ktae", n_groups=(3, 3), vocab=6)
    # Spread the ids far apart so densifying actually renumbers them.
    for g in req["groups"]:
        for r in g["rollouts"]:
            r["tokens"] = [t * 300_000_007 % (2**31 - 1) for t in r["tokens"]]
    expected = compute(req, device="cpu")
    monkeypatch.setattr(ktae_tables, "KEY_BITS", 20)
    got = compute(req, device="cpu")
    for g1, g2 in zip(expected["groups"], got["groups"], strict=True):
        for r1, r2 in zip(g1["rollouts"], g2["rollouts"], strict=True):
            np.testing.assert_array_equal(r1["advantages"], r2["advantages"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
@pytest.mark.parametrize("way", ["repeat_runs", "repeat_by_cumsum"])
def test_repeat_runs_equals_repeat_interleave_for_every_bit_pattern(dtype, way):
    # repeat_runs is numpy's repeat on the CPU; the accelerators' cumulative sum runs here too.
    from advantage_service import batch as batch_module

    repeat_runs = getattr(batch_module, way)

    gen = torch.Generator().manual_seed(3)
    runs = torch.randint(1, 6, (200,), generator=gen)
    if dtype.is_floating_point:
        # Every float32 bit pattern class: signs, zeros, subnormals, infinities, huge and tiny.
        special = torch.tensor(
            [0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), float("-inf"), 1.0, -1.0],
            dtype=dtype,
        )
        values = torch.cat([special, torch.randn(190, generator=gen, dtype=dtype) * 1e6])
    else:
        values = torch.randint(-(2**31), 2**31 - 1, (200,), generator=gen).to(dtype)
    starts = torch.cumsum(runs, 0) - runs
    got = repeat_runs(values, starts, int(runs.sum()))
    want = torch.repeat_interleave(values, runs)
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit (-0.0 too)


@pytest.mark.integration
def test_a_bad_setting_is_one_line_and_exit_2_without_a_traceback():
    for args, env, name in (
        (["--redis-url", "foo://bar"], {}, "ADV_REDIS_URL"),
        (["--max-inflight", "0"], {}, "ADV_MAX_INFLIGHT"),
        ([], {"ADV_MAX_QUEUE": "many"}, "ADV_MAX_QUEUE"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "advantage_service", "serve", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and name in lines[0] and "Traceback" not in proc.stderr, lines


def test_every_setting_has_a_serve_flag_that_overrides_its_variable(monkeypatch):
    from advantage_service.cli import build_parser
    from advantage_service.config import Settings
    from advantage_service.transports.server import settings_from_args

    parser = build_parser()
    # Every flag's dest is in the parsed namespace (its default None when not given).
    flags = set(vars(parser.parse_args(["serve"])))
    assert set(Settings.model_fields) <= flags
    monkeypatch.setenv("ADV_MAX_QUEUE", "9")
    monkeypatch.setenv("ADV_MAX_BATCH_TOKENS", "5")
    args = parser.parse_args(["serve", "--max-queue", "7", "--queue-timeout-seconds", "2.5"])
    settings = settings_from_args(args)
    assert (settings.max_queue, settings.queue_timeout_seconds) == (7, 2.5)
    assert settings.max_batch_tokens == 5  # from the variable: no flag given
