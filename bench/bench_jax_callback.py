"""The host round trip of ``compute_padded`` inside ``jax.jit`` (advantage_client.jax_callback),
on the CPU, in an environment with JAX (tests/trainers/jax_support.py's):

    python bench/bench_jax_callback.py [--rows 64] [--length 1024] [--group 8]
        [--estimators grpo,ktae] [--repeats 21] [--url http://HOST:PORT]

Per estimator, the median of ``--repeats`` calls (after two warm-up calls) of:

- ``plain``: ``compute_padded`` on host numpy arrays, outside jit (the computation alone);
- ``jit``: a jitted step that calls it through ``compute_padded_in_jit`` on JAX arrays and
  uses the answer (the device-to-host copy, the callback, the computation, the copy back);
- ``empty-callback``: a jitted step whose ``pure_callback`` returns zeros of the same shapes
  (the callback machinery and the copies alone).

In-process by default; ``--url`` measures an HTTP (Arrow) client of a running service instead.
Prints one line per estimator: the three medians and ``jit - plain``, the round trip's cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from advantage_client import HttpClient
from advantage_client.jax_callback import compute_padded_in_jit
from advantage_contract.backend import inprocess


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--estimators", default="grpo,ktae")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--url", default=None)
    args = parser.parse_args()
    b, t = args.rows, args.length
    rng = np.random.default_rng(0)
    lengths = rng.integers(t // 4, t + 1, b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    tokens = np.where(mask, rng.integers(0, 32000, (b, t)), 0).astype(np.int32)
    rewards = rng.integers(0, 2, b).astype(np.float32)
    group_ids = (np.arange(b) // args.group).astype(np.int32)
    backend: Any = HttpClient(args.url) if args.url else inprocess()
    on_device = [jnp.asarray(x) for x in (tokens, mask, rewards, group_ids)]
    where = f"HTTP {args.url}" if args.url else "in-process"
    print(
        f"{b} rows x {t} tokens ({int(mask.sum())} real), groups of {args.group}, {where}, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )

    @jax.jit
    def empty(tok: Any, m: Any, r: Any, g: Any) -> Any:
        def host(*_: Any) -> tuple[np.ndarray, np.ndarray]:
            return np.zeros((b, t), np.float32), np.zeros(b, np.float32)

        shapes = (
            jax.ShapeDtypeStruct((b, t), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.float32),
        )
        adv, _ = jax.pure_callback(host, shapes, tok, m, r, g)
        return (adv * m).sum()

    empty_ms = median_ms(lambda: empty(*on_device), args.repeats)
    for estimator in args.estimators.split(","):

        @jax.jit
        def step(tok: Any, m: Any, r: Any, g: Any, estimator: str = estimator) -> Any:
            adv, _ = compute_padded_in_jit(backend, tok, m, r, g, estimator=estimator)
            return (adv * m).sum()

        plain_ms = median_ms(
            lambda e=estimator: backend.compute_padded(
                tokens, mask, rewards, group_ids, estimator=e
            ),
            args.repeats,
        )
        jit_ms = median_ms(lambda s=step: s(*on_device), args.repeats)
        print(
            f"{estimator:>6}: plain {plain_ms:7.2f} ms  jit {jit_ms:7.2f} ms  "
            f"empty-callback {empty_ms:6.2f} ms  "
            f"round trip (jit - plain) {jit_ms - plain_ms:+6.2f} ms"
        )


if __name__ == "__main__":
    main()
