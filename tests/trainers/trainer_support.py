"""A real service process for the trainer tests, and its request counter."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from service_support import Service
from trainer_envs import ensure_env, run_in_env


class TrainerService(Service):
    """``advantage-service serve`` with an HTTP port (``url``) and a gRPC port (``target``),
    counting the requests it answered."""

    def requests(self, transport: str | None = None, estimator: str | None = None) -> float:
        """advantage_requests_total answered 200, summed over the labels not given."""
        total = 0.0
        for (name, labels), value in self.metrics().items():
            if name != "advantage_requests_total":
                continue
            found = dict(labels)
            if found.get("code") != "200":
                continue
            # (HTTP's label says the body format: http_arrow, http_json)
            if transport is not None and not found.get("transport", "").startswith(transport):
                continue
            if estimator is not None and found.get("estimator") != estimator:
                continue
            total += value
        return total


def run_step(
    service: TrainerService, env: Any, step: Path, cases: list[Any], timeout: float = 400
) -> dict[str, Any]:
    """One run of a trainer's step script in the trainer's environment ``env``, every transport
    in it (in-process, HTTP and gRPC to ``service``): the ``RESULT <json>`` line it prints, with
    the requests the service answered meanwhile (``service_requests``) and the environment's
    interpreter (``python``)."""
    python = ensure_env(env)
    transports = [["inprocess", None], ["http", service.url], ["grpc", service.target]]
    before = service.requests()
    config = {"transports": transports, "cases": cases}
    done = run_in_env(python, step, json.dumps(config), service=True, timeout=timeout)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    result["service_requests"] = service.requests() - before
    result["python"] = python
    return result


def run_steps(python: Path, steps: Path, folder: Path, service: TrainerService) -> dict[str, Any]:
    """One run of a trainer's steps script (in-process, HTTP and gRPC to ``service``) in the
    trainer's environment ``python``, on the cases saved in ``folder/cases.npz``: the arrays it
    saved in ``folder/out.npz``."""
    run_in_env(
        python,
        steps,
        str(folder / "cases.npz"),
        str(folder / "out.npz"),
        service.url,
        service.target,
        service=True,
        timeout=300,
    )
    return dict(np.load(folder / "out.npz"))


def tiny_grpo_config(tmp_path: Path, **settings: Any) -> Any:
    """TRL's ``GRPOConfig`` of one CPU step of 8 rows in groups of 4, completions of at most 8
    tokens, nothing saved or reported (each run in its own folder under ``tmp_path``);
    ``settings`` add to it or replace its values."""
    from trl import GRPOConfig

    base: dict[str, Any] = {
        "output_dir": str(tmp_path / uuid.uuid4().hex[:8]),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
    }
    return GRPOConfig(**{**base, **settings})
