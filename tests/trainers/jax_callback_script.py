"""Run in the JAX environment by test_jax_callback.py: advantages inside ``jax.jit`` through
``compute_padded_in_jit`` (in-process, HTTP, gRPC; pure and ordered callbacks), against the
same backend's ``compute_padded`` outside jit. Writes the answers to an .npz, and the error of a
client call made directly inside jit.

usage: jax_callback_script.py URL TARGET OUT.npz
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from advantage_client import GrpcClient, HttpClient
from advantage_client.jax_callback import compute_padded_in_jit
from advantage_contract.backend import inprocess

B, T, G = 8, 5, 4


def main(url: str, target: str, out_path: str) -> None:
    rng = np.random.default_rng(3)
    lengths = np.array([5, 2, 4, 1, 3, 5, 2, 4])
    mask = np.arange(T)[None, :] < lengths[:, None]
    tokens = np.where(mask, rng.integers(0, 9, (B, T)), 0).astype(np.int32)
    rewards = rng.integers(0, 2, B).astype(np.float32)
    group_ids = np.repeat(np.arange(B // G), G).astype(np.int32)
    backends = {"inprocess": inprocess(), "http": HttpClient(url), "grpc": GrpcClient(target)}
    out: dict[str, np.ndarray] = {"mask": mask}
    for name, backend in backends.items():
        for estimator in ("grpo", "ktae"):
            plain = backend.compute_padded(tokens, mask, rewards, group_ids, estimator=estimator)
            out[f"{name}/{estimator}/plain"] = np.asarray(plain.advantages)
            for ordered in (False, True):

                @jax.jit
                def step(tok, m, r, g, backend=backend, estimator=estimator, ordered=ordered):
                    adv, scalars = compute_padded_in_jit(
                        backend, tok, m, r, g, estimator=estimator, ordered=ordered
                    )
                    # (used inside the compiled step, as a loss would)
                    return adv * 2.0, scalars

                adv, _ = step(
                    jnp.asarray(tokens),
                    jnp.asarray(mask),
                    jnp.asarray(rewards),
                    jnp.asarray(group_ids),
                )
                out[f"{name}/{estimator}/{'ordered' if ordered else 'pure'}"] = np.asarray(adv) / 2

    @jax.jit
    def direct(tok, m, r, g):
        return jnp.asarray(backends["http"].compute_padded(tok, m, r, g).advantages)

    try:
        direct(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(rewards), jnp.asarray(group_ids))
        out["direct_error"] = np.array("")
    except Exception as exc:  # (what a trainer sees: the error names the way out)
        out["direct_error"] = np.array(f"{type(exc).__name__}: {exc}")
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
