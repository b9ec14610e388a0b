"""Run in Tinker's environment: datums built with the SDK's own types (``tinker.Datum``,
``ModelInput``, ``TensorData``) laid out as the cookbook's ``trajectory_to_data`` lays them out
(input tokens right-shifted, targets left-shifted, ``mask`` 0 on observation tokens), their
advantages filled by the integration over each transport; each datum's ``loss_fn_inputs`` into
``out.npz`` (``<transport>:<estimator>:<field>``, rows padded with NaN).

Usage: ``tinker_steps.py cases.npz out.npz HTTP_URL GRPC_TARGET`` (``-`` skips a transport)
"""

from __future__ import annotations

import sys
import time

import numpy as np
import tinker
from advantage_client.integrations.tinker import TinkerAdvantages, TinkerInputError
from tinker import TensorData

ESTIMATORS = ("dr_grpo", "grpo", "ktae")
HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}


def datums(case: dict[str, np.ndarray], name: str) -> list[tinker.Datum]:
    out = []
    for tokens, mask, length in zip(
        case[f"{name}_targets"], case[f"{name}_mask"], case[f"{name}_lengths"], strict=True
    ):
        targets = tokens[:length].astype(np.int64)
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints([1, *targets[:-1].tolist()]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(targets),
                    "logprobs": TensorData.from_numpy(np.full(length, -0.5, np.float32)),
                    "advantages": TensorData.from_numpy(np.zeros(length, np.float32)),
                    "mask": TensorData.from_numpy(mask[:length].astype(np.float32)),
                },
            )
        )
    return out


def prompted(case: dict[str, np.ndarray], name: str) -> list[tinker.Datum]:
    """One datum per rollout as a single-turn cookbook datum: its group's prompt, then its own
    tokens (the prompt's tokens after the first are targets with mask 0)."""
    out = []
    groups = {g: k for k, g in enumerate(sorted(set(case[f"{name}_groups"].tolist())))}
    for tokens, mask, group in zip(
        case[f"{name}_targets"], case[f"{name}_mask"], case[f"{name}_groups"], strict=True
    ):
        prompt = [1, 100 + groups[str(group)], 200 + groups[str(group)]]
        full = np.asarray([*prompt, *tokens[mask].tolist()], dtype=np.int64)
        own = np.r_[np.zeros(len(prompt) - 1), np.ones(int(mask.sum()))].astype(np.float32)
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(full[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_numpy(full[1:]),
                    "mask": TensorData.from_numpy(own),
                },
            )
        )
    return out


def padded(data: list[tinker.Datum], field: str, width: int) -> np.ndarray:
    rows = np.full((len(data), width), np.nan)
    for i, datum in enumerate(data):
        values = datum.loss_fn_inputs[field].to_numpy()
        rows[i, : values.size] = values
    return rows


def main(cases_path: str, out_path: str, http_url: str, grpc_target: str) -> None:
    case = dict(np.load(cases_path))
    out: dict[str, np.ndarray] = {}
    for transport, url in (("inprocess", None), ("http", http_url), ("grpc", grpc_target)):
        if url == "-":
            continue
        for name in ESTIMATORS:
            data = datums(case, name)
            filler = TinkerAdvantages(name, transport=transport, url=url)
            filled = filler.fill(data, case[f"{name}_rewards"].tolist(), case[f"{name}_groups"])
            assert all(type(d) is tinker.Datum for d in filled)
            assert all(d.loss_fn_inputs["advantages"].dtype == "float32" for d in filled)
            width = case[f"{name}_targets"].shape[1]
            for field in ("advantages", "target_tokens", "mask", "logprobs"):
                out[f"{transport}:{name}:{field}"] = padded(filled, field, width)
        if transport != "inprocess":  # history keyed by the prompt: a revisit moves the answer
            data = prompted(case, "ktae")
            filler = TinkerAdvantages(HISTORY, transport=transport, url=url)
            rewards, groups = case["ktae_rewards"].tolist(), case["ktae_groups"]
            first = padded(filler.fill(data, rewards, groups), "advantages", 64)
            # (the service records a request's statistics after answering it: the revisit may
            # come before they are written, so it is tried again for a few seconds)
            for _ in range(50):
                time.sleep(0.1)
                again = padded(filler.fill(data, rewards, groups), "advantages", 64)
                if not np.allclose(first, again, equal_nan=True):
                    break
            else:
                raise AssertionError(f"{transport}: a revisit left KTAE's history unchanged")
    # a datum without a mask (the cookbook removes it before sending) is named
    data = datums(case, "grpo")
    bare = [
        data[0],
        tinker.Datum(
            model_input=data[1].model_input,
            loss_fn_inputs={"target_tokens": data[1].loss_fn_inputs["target_tokens"]},
        ),
    ]
    try:
        TinkerAdvantages("grpo").fill(bare, [0.0, 1.0], [0, 0])
    except TinkerInputError as exc:
        assert "datum 1" in str(exc) and "mask" in str(exc), exc
    else:
        raise AssertionError("a datum without a mask was taken")
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
