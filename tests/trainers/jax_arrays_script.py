"""Run in the JAX environment by test_jax_arrays.py: one batch given as JAX arrays (float32,
bfloat16, x64, sharded over two CPU devices; per rollout, a 0-d JAX reward) through every path
of both clients and the in-process API, and the same values as numpy float32 through the same
paths. Writes every answer to an .npz: ``<variant>/<path>/<estimator>`` and the numpy answer
under ``numpy/<path>/<estimator>`` of the variant's (rounded) values.

usage: jax_arrays_script.py URL TARGET OUT.npz
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

jax.config.update("jax_enable_x64", True)

import advantage_service  # noqa: E402
from advantage_client import GrpcClient, HttpClient  # noqa: E402
from advantage_client.padding import to_padded  # noqa: E402

B, T, G = 8, 6, 4
ESTIMATORS = {"ktae": {}, "gtpo": {"entropy": True}}


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    lengths = np.array([6, 3, 5, 1, 4, 6, 2, 5])
    mask = np.arange(T)[None, :] < lengths[:, None]
    return {
        "tokens": np.where(mask, rng.integers(0, 12, (B, T)), 0).astype(np.int32),
        "mask": mask,
        "rewards": rng.normal(size=B).astype(np.float32),
        "entropy": np.where(mask, rng.uniform(0.05, 3.0, (B, T)), 0).astype(np.float32),
    }


def variants(base: dict[str, np.ndarray]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name -> (the JAX arrays, the numpy float32/int32 arrays of the same values)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    out = {}
    for name, dtype, ids in (
        ("float32", jnp.float32, jnp.int32),
        ("bfloat16", jnp.bfloat16, jnp.int32),
        ("x64", jnp.float64, jnp.int64),
        ("sharded", jnp.float32, jnp.int32),
    ):
        given = {
            "tokens": jnp.asarray(base["tokens"], dtype=ids),
            "mask": jnp.asarray(base["mask"]),
            "rewards": jnp.asarray(base["rewards"], dtype=dtype),
            "entropy": jnp.asarray(base["entropy"], dtype=dtype),
        }
        if name == "sharded":
            given = {k: jax.device_put(v, rows) for k, v in given.items()}
            assert len(given["rewards"].sharding.device_set) == 2
        # (numpy of the values the JAX arrays hold: bfloat16-rounded where they are)
        same = {
            k: np.asarray(v.astype(jnp.float32))
            if jnp.issubdtype(v.dtype, jnp.floating)
            else np.asarray(v)
            for k, v in given.items()
        }
        same["tokens"] = same["tokens"].astype(np.int32)
        out[name] = (given, same)
    return out


def nested_request(values: dict[str, Any], estimator: str, entropy: bool) -> dict[str, Any]:
    """The batch as the JSON request's groups: each value a slice of the arrays given (JAX
    arrays stay JAX arrays; a reward is a 0-d one)."""
    lengths = np.asarray(values["mask"]).sum(1)
    rollouts = []
    for i in range(B):
        n = int(lengths[i])
        rollout = {"tokens": values["tokens"][i, :n], "reward": values["rewards"][i]}
        if entropy:
            rollout["entropy"] = values["entropy"][i, :n]
        rollouts.append(rollout)
    groups = [{"id": f"g{g}", "rollouts": rollouts[g * G : (g + 1) * G]} for g in range(B // G)]
    return {"estimator": estimator, "groups": groups}


def stream_rollouts(values: dict[str, Any], entropy: bool) -> list[dict[str, Any]]:
    request = nested_request(values, "", entropy)
    out = []
    for group in request["groups"]:
        for i, rollout in enumerate(group["rollouts"]):
            item = dict(
                rollout, group_id=group["id"], group_size=G, rollout_id=f"{group['id']}-{i}"
            )
            out.append(item)
    return out


def main(url: str, target: str, out_path: str) -> None:
    clients = {
        "http_json": HttpClient(url, wire="json"),
        "http_arrow": HttpClient(url, wire="arrow"),
        "grpc": GrpcClient(target),
    }
    base_mask = batch()["mask"]
    group_ids = np.repeat(np.arange(B // G), G)
    paths: dict[str, Callable[[dict[str, Any], str, bool], np.ndarray]] = {}

    def nested(client: Any) -> Callable[[dict[str, Any], str, bool], np.ndarray]:
        def run(values: dict[str, Any], estimator: str, entropy: bool) -> np.ndarray:
            response = client.compute(nested_request(values, estimator, entropy))
            return to_padded(response, mask=base_mask)[0]

        return run

    def padded(compute: Any) -> Callable[[dict[str, Any], str, bool], np.ndarray]:
        def run(values: dict[str, Any], estimator: str, entropy: bool) -> np.ndarray:
            result = compute(
                values["tokens"],
                values["mask"],
                values["rewards"],
                group_ids,
                estimator=estimator,
                entropy=values["entropy"] if entropy else None,
            )
            return np.asarray(result.advantages)

        return run

    def stream(values: dict[str, Any], estimator: str, entropy: bool) -> np.ndarray:
        rollouts = stream_rollouts(values, entropy)
        results = list(clients["grpc"].stream(rollouts, estimator=estimator))
        order = [r["rollout_id"] for r in rollouts]
        return to_padded(results, order=order, mask=base_mask)[0]

    for name, client in clients.items():
        paths[f"compute_{name}"] = nested(client)
    paths["stream_grpc"] = stream
    paths["padded_http"] = padded(clients["http_arrow"].compute_padded)
    paths["padded_grpc"] = padded(clients["grpc"].compute_padded)
    paths["padded_inprocess"] = padded(advantage_service.compute_padded)

    results: dict[str, np.ndarray] = {}
    for variant, (given, same) in variants(batch()).items():
        for path, run in paths.items():
            for estimator, options in ESTIMATORS.items():
                entropy = bool(options.get("entropy"))
                key = f"{path}/{estimator}"
                results[f"{variant}/{key}"] = run(given, estimator, entropy)
                results[f"numpy-{variant}/{key}"] = run(same, estimator, entropy)
    results.update({f"base/{k}": v for k, v in batch().items()})
    np.savez(out_path, **results)
    print(f"{len(results)} answers, devices {jax.devices()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
