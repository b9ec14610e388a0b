"""``compute_padded`` inside ``jax.jit``: the call runs on the host through
``jax.pure_callback`` (or ``jax.experimental.io_callback``), so a jitted train step can take the
service's advantages without leaving the compiled function.

A client call made directly inside ``jit`` fails with ``TracerArrayConversionError``: under
tracing the arrays have no values yet. The callback hands the host function the concrete
arrays when the step runs; the answer comes back as (B, T) float32 advantages and (B,) float32
scalars on the default device. Each call is a device-to-host copy of its inputs, the
computation (in-process, or a request to the service) and a host-to-device copy of the answer
(measured in bench/bench_jax_callback.py).

``pure_callback`` lets XLA drop a call whose answer is unused or repeat one; an estimator with
history (KTAE's ``history: "prompt"``) writes to the service's store on each call, so it asks
for ``ordered=True``: ``io_callback``, called exactly once per step, in order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from advantage_contract.arrays import to_numpy
from advantage_contract.fields import TOKEN_FIELDS

# compute_padded's per-token keywords (arrays, traced inside jit); the other keywords are static.
ARRAY_KEYWORDS = TOKEN_FIELDS


def compute_padded_in_jit(
    backend: Any,
    tokens: Any,
    mask: Any,
    rewards: Any,
    group_ids: Any,
    *,
    ordered: bool = False,
    **options: Any,
) -> tuple[Any, Any]:
    """``backend.compute_padded`` (an ``HttpClient``, a ``GrpcClient`` or
    ``advantage_contract.backend.inprocess()``) callable inside ``jax.jit``: ``(advantages
    (B, T) float32, scalars (B,) float32)`` as JAX arrays.

    ``tokens``, ``mask``, ``rewards``, ``group_ids`` (integers) and the per-token keywords
    (``logprobs``, ``entropy``, ...) may be traced; ``teacher_logprobs`` a mapping of traced
    arrays; the other keywords (``estimator``, ``namespace``, ``prompt_keys``, ...) are fixed
    when the function is traced. ``ordered``: call through ``io_callback`` (exactly once per
    step, in order: for an estimator with history) instead of ``pure_callback``.
    """
    import jax
    import jax.numpy as jnp

    teachers = dict(options.pop("teacher_logprobs", None) or {})
    traced = {k: options.pop(k) for k in ARRAY_KEYWORDS if options.get(k) is not None}
    names = ["tokens", "mask", "rewards", "group_ids", *traced, *(f"t:{k}" for k in teachers)]
    operands = [tokens, mask, rewards, group_ids, *traced.values(), *teachers.values()]
    if tokens is None:  # (an outcome preset: no ids)
        names, operands = names[1:], operands[1:]
    b, t = jnp.shape(mask)

    def host(*values: Any) -> tuple[np.ndarray, np.ndarray]:
        given = {n: to_numpy(v, n) for n, v in zip(names, values, strict=True)}
        teacher = {n[2:]: given.pop(n) for n in list(given) if n.startswith("t:")}
        result = backend.compute_padded(
            given.pop("tokens", None),
            given.pop("mask"),
            given.pop("rewards"),
            given.pop("group_ids"),
            teacher_logprobs=teacher or None,
            **given,
            **options,
        )
        return (
            np.asarray(to_numpy(result.advantages, "advantages"), dtype=np.float32),
            np.asarray(to_numpy(result.scalars, "scalars"), dtype=np.float32),
        )

    shapes = (
        jax.ShapeDtypeStruct((b, t), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.float32),
    )
    if ordered:
        from jax.experimental import io_callback

        return tuple(io_callback(host, shapes, *operands, ordered=True))
    return tuple(jax.pure_callback(host, shapes, *operands))
