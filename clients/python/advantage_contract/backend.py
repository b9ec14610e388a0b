"""What every backend of the padded API implements, and how the in-process one is found.

A backend is anything with :meth:`Backend.compute_padded` and :meth:`Backend.list_estimators`:
``HttpClient`` and ``GrpcClient`` (a running service) and the service library in the trainer's
own process. The integrations call one backend whatever the transport. The two clients share
:class:`RemoteBackend`: one ``compute_padded`` that checks a padded call and gathers it into the
flat layout, which each client then sends its way.

The in-process backend lives in the service package, which this distribution never imports:
the service declares it as the entry point ``inprocess`` of the group
``advantage_contract.backends`` (its ``pyproject.toml``), and :func:`inprocess` loads it. So a
trainer environment with ``advantage-service`` installed computes in-process, and one without
it gets an error saying what to install.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

from . import CONTRACT_VERSION
from .padded import FlatRequest, PaddedResult, flat_request

ENTRY_POINT_GROUP = "advantage_contract.backends"


@runtime_checkable
class Backend(Protocol):
    """The padded API, the same on every transport (names, order and defaults: a test compares
    each implementation's signature with this one)."""

    def compute_padded(
        self,
        tokens: Any,
        mask: Any,
        rewards: Any,
        group_ids: Any,
        *,
        estimator: Any = "grpo",
        logprobs: Any = None,
        teacher_logprobs: Mapping[str, Any] | None = None,
        entropy: Any = None,
        sum_pi_squared: Any = None,
        is_weights: Any = None,
        returns: Any = None,
        planning_mask: Any = None,
        diagnostics: Sequence[str] = (),
        ignore_token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
        request_id: str | None = None,
        prompt_keys: Any = None,
        reward_components: Mapping[str, Any] | None = None,
    ) -> PaddedResult:
        """Per-token advantages of a padded (B, T) batch (see
        :meth:`RemoteBackend.compute_padded`)."""
        ...

    def list_estimators(self) -> dict[str, Any]:
        """The service's estimator listing (``GET /v1/estimators``)."""
        ...


class RemoteBackend(ABC):
    """The padded API of a client of a running service: :meth:`compute_padded` checks the
    arrays and gathers them into the flat layout (:func:`~.padded.flat_request`), and the
    client's :meth:`_compute_flat` sends them and scatters the answer back. A context manager
    that closes the client's connection."""

    # How errors name this client ("the HTTP client"): it refuses what it cannot carry yet.
    client_name: ClassVar[str]

    @abstractmethod
    def _compute_flat(self, req: FlatRequest) -> PaddedResult:
        """Send ``req`` to the service; its answer in the padded layout."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection to the service."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compute_padded(
        self,
        tokens: Any,
        mask: Any,
        rewards: Any,
        group_ids: Any,
        *,
        estimator: Any = "grpo",
        logprobs: Any = None,
        teacher_logprobs: Mapping[str, Any] | None = None,
        entropy: Any = None,
        sum_pi_squared: Any = None,
        is_weights: Any = None,
        returns: Any = None,
        planning_mask: Any = None,
        diagnostics: Sequence[str] = (),
        ignore_token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
        request_id: str | None = None,
        prompt_keys: Any = None,
        reward_components: Mapping[str, Any] | None = None,
    ) -> PaddedResult:
        """Advantages for a trainer's padded batch, sent as the flat layout: Arrow columns over
        HTTP (whatever ``wire`` says: the padded path has no per-rollout dicts to send as
        JSON), raw tensors in one unary ``Compute`` over gRPC.

        ``tokens``, ``mask`` and the per-token arrays (B, T) (numpy, torch, anything with
        ``__array__`` or DLPack); a rollout's tokens are where ``mask`` is true, in order;
        ``rewards`` (B,); ``group_ids`` (B,) strings or integers in any order. Returns
        :class:`~advantage_contract.padded.PaddedResult` of numpy arrays: ``advantages`` (B, T)
        float32 with 0 off the mask, ``scalars`` (B,), ``diagnostics`` {name: (B, T)}. An
        estimator with no token-level term sends zeros for the token ids (``tokens`` may be
        None). ``prompt_keys`` (B,): per row, the key of its group's history (KTAE
        ``history: "prompt"``; every row of a group the same), so that one prompt's visits under
        new group ids share it; None keys history by the group ids. ``reward_components``
        {name: (B,)}: named rewards per row (NaN where a row has none); a row whose reward is
        NaN gets the weighted sum of its components. Raises :class:`AdvantageError`.
        """
        req = flat_request(
            tokens,
            mask,
            rewards,
            group_ids,
            client=self.client_name,
            estimator=estimator,
            logprobs=logprobs,
            entropy=entropy,
            sum_pi_squared=sum_pi_squared,
            is_weights=is_weights,
            returns=returns,
            planning_mask=planning_mask,
            teacher_logprobs=teacher_logprobs,
            diagnostics=diagnostics,
            ignore_token_ids=ignore_token_ids,
            namespace=namespace,
            request_id=request_id,
            prompt_keys=prompt_keys,
            reward_components=reward_components,
        )
        return self._compute_flat(req)


def inprocess() -> Backend:
    """The service library computing in this process (torch in, torch out), found through the
    entry point the service package declares."""
    why = (
        "transport 'inprocess' computes with the service library in this process, which is not "
        "installed here: `pip install advantage-service` (or use transport 'http' or 'grpc' "
        "with a running service's url)"
    )
    for entry in entry_points(group=ENTRY_POINT_GROUP, name="inprocess"):
        try:
            backend: Backend = entry.load()()
        except ModuleNotFoundError as exc:  # (declared by an uninstalled or broken service)
            raise ModuleNotFoundError(f"{why}: {exc}") from exc
        return backend
    raise ModuleNotFoundError(why)


def check_contract(listing: Mapping[str, Any], where: str) -> bool:
    """Warn when ``listing`` (an estimator listing) comes from a service of another contract
    version than this client's; True when they agree."""
    theirs = listing.get("contract")
    if theirs == CONTRACT_VERSION:
        return True
    warnings.warn(
        f"{where} speaks contract version {theirs if theirs is not None else '1 (unlisted)'}, "
        f"this client version {CONTRACT_VERSION}: fields, limits or methods may differ "
        "(upgrade the older side; what one side lacks is refused by name, not dropped)",
        ContractMismatch,
        stacklevel=3,
    )
    return False


class ContractMismatch(UserWarning):
    """A client and a service of different contract versions."""
