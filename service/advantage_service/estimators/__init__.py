"""Estimators: pure torch functions over the flat batch, registered by name.

Importing this package registers every outcome baseline and term (the modules register
themselves); nothing else dispatches on names.
"""

# Registration order is the order outcomes are listed and terms appear in resolved estimators:
# outcomes grpo ... grpo_passk, otb, maxrl, gtpo, grpo_s, gdpo; terms ktae, cscr, opsd, forking,
# hicra.
# (imported for their registration side effects)
from . import baselines, otb, maxrl, gtpo, grpo_s, gdpo, ktae, cscr, opsd, forking, hicra  # noqa: F401, I001
from .pipeline import AdvantageResult, compute_batch, resolve_device, whiten
from .registry import OUTCOMES, TERMS, Param, TermContext
from .spec import EstimatorSpec, presets, resolve_estimator

__all__ = [
    "OUTCOMES",
    "TERMS",
    "AdvantageResult",
    "EstimatorSpec",
    "Param",
    "TermContext",
    "compute_batch",
    "presets",
    "resolve_device",
    "resolve_estimator",
    "whiten",
]
