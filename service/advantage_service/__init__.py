"""advantage-service: model-free per-token advantage estimation for RL post-training of LLMs.

Python API (same numbers as the server):

- :func:`compute`: the JSON request dict in, the response dict out.
- :class:`RolloutBatch` ``.from_flat(...)`` and :func:`compute_batch`: the flat fast path.
- :func:`compute_padded`: a trainer's (B, T) padded tensors in, (B, T) advantages out.
"""

from .api import compute
from .batch import RolloutBatch
from .errors import LimitExceeded, RequestError
from .estimators import AdvantageResult, EstimatorSpec, compute_batch, presets, resolve_estimator
from .version import __version__
from .wire.padded import PaddedResult, compute_padded

__all__ = [
    "AdvantageResult",
    "EstimatorSpec",
    "LimitExceeded",
    "PaddedResult",
    "RequestError",
    "RolloutBatch",
    "__version__",
    "compute",
    "compute_batch",
    "compute_padded",
    "presets",
    "resolve_estimator",
]
