"""advantage-service: model-free per-token advantage estimation for RL post-training of LLMs.

Python API (same numbers as the server):

- :func:`compute`: the JSON request dict in, the response dict out.
- :class:`RolloutBatch` ``.from_flat(...)`` and :func:`compute_batch`: the flat fast path.
"""

from .api import compute
from .batch import RolloutBatch
from .errors import LimitExceeded, RequestError
from .estimators import AdvantageResult, EstimatorSpec, compute_batch, presets, resolve_estimator

__version__ = "0.1.0"

__all__ = [
    "AdvantageResult",
    "EstimatorSpec",
    "LimitExceeded",
    "RequestError",
    "RolloutBatch",
    "__version__",
    "compute",
    "compute_batch",
    "presets",
    "resolve_estimator",
]
