"""Arrays and numbers from any framework as numpy, in one place: every path of both clients
and of the in-process API reads a trainer's values through here.

Accepted: numpy arrays and scalars, torch tensors (any device, any dtype, with or without
grad), JAX arrays (any device, sharded over a mesh, float64/int64 under x64), anything with
``__array__`` or DLPack, and lists. Half precision (float16, bfloat16, ml_dtypes' small
floats) is widened to float32, which holds every such value exactly; other dtypes are kept as
they are (the callers narrow ids and widen values with their own checks, so an id wider than
int32 is refused there, naming its field). An array already on the host in its final dtype is
not copied: a JAX CPU array and a CPU torch tensor come back as numpy views of their memory
(read-only for JAX; :func:`torch_tensor` makes a torch tensor of one).

Neither torch nor JAX is imported here: a tensor is recognised by its type's module, so a
trainer without them never loads them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import AdvantageError

# ml_dtypes' floats narrower than float32 (what numpy gives for a JAX bfloat16 array): numpy
# does not compute with them, float32 holds them exactly.
_SMALL_FLOAT_PREFIXES = ("bfloat16", "float8", "float6", "float4")


def _framework(value: Any) -> str:
    """``"torch"``, ``"jax"`` or ``""`` from the module of ``value``'s type (no import)."""
    module = type(value).__module__
    root = module.partition(".")[0]
    if root == "torch":
        return "torch"
    if root in ("jax", "jaxlib"):
        return "jax"
    return ""


def widen(array: np.ndarray) -> np.ndarray:
    """Half-precision floats as float32 (exact); anything else as it is, uncopied."""
    dtype = array.dtype
    if dtype.kind == "f" and dtype.itemsize < 4:
        return array.astype(np.float32)
    if dtype.kind == "V" and dtype.name.startswith(_SMALL_FLOAT_PREFIXES):
        return array.astype(np.float32)
    return array


def _torch_numpy(tensor: Any) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.is_floating_point() and tensor.element_size() < 4:  # numpy has no bfloat16
        tensor = tensor.float()
    tensor = tensor.cpu()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    return np.asarray(tensor.numpy())


def to_numpy(values: Any, name: str = "values") -> np.ndarray:
    """``values`` as a numpy array on the host: see the module's docstring for what is
    accepted. Raises :class:`AdvantageError` (``invalid_type``, naming ``name``) for anything
    that is not an array."""
    if isinstance(values, np.ndarray):
        return widen(values)
    framework = _framework(values)
    try:
        if framework == "torch" or (hasattr(values, "detach") and hasattr(values, "cpu")):
            return _torch_numpy(values)
        if framework == "jax" or isinstance(values, np.generic | list | tuple):
            # (a sharded JAX array is gathered from its devices; one on the CPU is a view)
            return widen(np.asarray(values))
        if hasattr(values, "__array__"):
            return widen(np.asarray(values))
        if hasattr(values, "__dlpack__"):
            return widen(np.from_dlpack(values))
    except (TypeError, ValueError, RuntimeError, BufferError) as exc:
        if framework == "jax" and "Tracer" in type(values).__name__:
            raise AdvantageError(
                "invalid_type",
                f"{name} is a traced JAX array (inside jax.jit or another transform), which has "
                "no values yet: call through advantage_client.jax_callback."
                "compute_padded_in_jit",
                field=name,
            ) from None
        raise AdvantageError(
            "invalid_type", f"{name} cannot be read as an array: {exc}", field=name
        ) from None
    raise AdvantageError(
        "invalid_type",
        f"{name} is not an array (numpy, torch, JAX, DLPack), got {type(values).__name__}",
        field=name,
    )


def is_array(value: Any) -> bool:
    """Whether ``value`` is an array or tensor (numpy, torch, JAX, ``__array__``, DLPack),
    not a list or a plain number."""
    return (
        isinstance(value, np.ndarray | np.generic)
        or _framework(value) != ""
        or hasattr(value, "__array__")
        or hasattr(value, "__dlpack__")
    )


def to_number(value: Any) -> Any:
    """Where one number is asked: a 0-d array or tensor of any framework, or a numpy scalar,
    as the Python number it holds (half precision widened); anything else unchanged, for the
    caller's check to name."""
    kind = type(value)
    if kind is float or kind is int or kind is bool or value is None:
        return value
    if isinstance(value, np.generic) or (is_array(value) and getattr(value, "ndim", None) == 0):
        try:
            array = to_numpy(value)
        except AdvantageError:
            return value
        if array.ndim == 0 and array.dtype.kind in "biuf":
            return array.item()
    return value


def values_1d(values: Any, name: str, dtype: Any) -> np.ndarray:
    """A rollout's values (list or array of any framework) as a numpy array of ``dtype``,
    uncopied when it already is one."""
    return to_numpy(values, name).astype(dtype, copy=False)


def json_value(value: Any) -> Any:
    """An array, tensor or numpy scalar as JSON's lists and numbers (``json.dumps``'s
    ``default``); raises ``TypeError`` for anything else, as ``json`` does."""
    if not is_array(value):
        raise TypeError(f"not JSON serialisable: {type(value).__name__}")
    try:
        return to_numpy(value).tolist()
    except AdvantageError:
        raise TypeError(f"not JSON serialisable: {type(value).__name__}") from None


def torch_tensor(array: np.ndarray) -> Any:
    """A host numpy array as a CPU torch tensor, sharing its memory when it is writable. A
    read-only array (a JAX array's view) is copied: torch warns on sharing memory it may not
    write, and silencing that warning is not thread-safe. (In-process that is the mask and the
    rewards: the gathered per-token values are fresh arrays already.)"""
    import torch

    return torch.from_numpy(array if array.flags.writeable else array.copy())
