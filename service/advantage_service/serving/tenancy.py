"""What each client may hold at once: the service's budgets, and every tenant's share of them.

The service holds four things for its clients, each bounded by a setting:

============  ==============================  ==========================================
resource      the whole replica               what it counts
============  ==============================  ==========================================
``bodies``    ``ADV_MAX_RECEIVING``           HTTP bodies being received (not yet whole)
``requests``  ``ADV_MAX_QUEUE``               requests admitted: decoding, waiting, computing
``bytes``     ``ADV_MAX_QUEUE_BYTES``         bodies being received and admitted, and the
                                              rollouts gRPC streams hold for groups not yet
                                              complete: one memory budget for every transport
``streams``   ``ADV_STREAM_MAX_OPEN``         ``StreamCompute`` calls open
============  ==============================  ==========================================

A **tenant** is who holds them: the token's principal with authentication on (its ``name`` in
the tokens file, else ``token-<n>``), the client's address with it off (there is nothing else
to tell clients apart by before a body is read; behind a proxy that is the proxy's address).

**The rule**: no tenant holds more than its limit of each resource, by default
``ADV_TENANT_SHARE`` (one half) of the replica's budget, at least one; the tokens file may set
a token's own limits (``limits``). So a tenant at every limit leaves the others the rest: with
the default, at least half of every budget. A refusal is a 503 ``overloaded`` with a retry hint,
as for a full replica, naming the tenant's limit.

A lone request is admitted up to ``ADV_MAX_BODY_BYTES`` whatever the byte budgets say: the
replica's when it holds no other bytes, the tenant's when the tenant holds no other bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Literal

Resource = Literal["bodies", "requests", "bytes", "streams"]
RESOURCES: tuple[Resource, ...] = ("bodies", "requests", "bytes", "streams")

# What each resource is, in refusal messages, and the setting that bounds the replica's.
_NOUN = {
    "bodies": "bodies being received",
    "requests": "requests",
    "bytes": "bytes of requests",
    "streams": "open streams",
}
SETTING = {
    "bodies": "ADV_MAX_RECEIVING",
    "requests": "ADV_MAX_QUEUE",
    "bytes": "ADV_MAX_QUEUE_BYTES",
    "streams": "ADV_STREAM_MAX_OPEN",
}


@dataclass(frozen=True)
class Limits:
    """A number for each resource."""

    bodies: int
    requests: int
    bytes: int
    streams: int

    def of(self, resource: Resource) -> int:
        value: int = getattr(self, resource)
        return value

    def share(self, fraction: float) -> Limits:
        """``fraction`` of each, rounded up, at least 1."""
        return Limits(*(max(1, math.ceil(getattr(self, f.name) * fraction)) for f in fields(self)))

    def updated(self, overrides: Mapping[str, int] | None) -> Limits:
        """These limits with ``overrides`` (a tokens file's ``limits``) in place of some."""
        if not overrides:
            return self
        return Limits(
            **{f.name: overrides.get(f.name, getattr(self, f.name)) for f in fields(self)}
        )


@dataclass(frozen=True)
class Tenant:
    """Who holds resources: ``key`` tells tenants apart (the principal's name, or the client's
    address on an open service); ``label`` is what metrics show (the principal's name:
    ``anonymous`` on an open service, so that addresses never become label values)."""

    key: str
    label: str
    limits: Mapping[str, int] | None = field(default=None, compare=False)
    # Limited by the replica's budgets alone (in-process callers: there is no one to share with).
    whole: bool = False


@dataclass
class Usage:
    bodies: int = 0
    requests: int = 0
    bytes: int = 0
    streams: int = 0

    @property
    def empty(self) -> bool:
        return not (self.bodies or self.requests or self.bytes or self.streams)


class Refusal(Exception):
    """Taking a resource would pass a limit (the caller turns it into its 503)."""

    def __init__(self, message: str, resource: Resource, tenant: Tenant | None) -> None:
        super().__init__(message)
        self.resource = resource
        self.tenant = tenant


class Budget:
    """The counts of what every tenant holds, against the replica's limits and each tenant's.
    Use it from the event loop.

    ``on_held(label, resource, delta)``: what tenants of that label hold changed by ``delta``;
    ``on_refused(label, resource)``: a tenant of that label was refused (per-tenant metrics).
    """

    def __init__(
        self,
        total: Limits,
        share: float = 0.5,
        *,
        on_held: Callable[[str, Resource, int], None] | None = None,
        on_refused: Callable[[str, Resource], None] | None = None,
    ) -> None:
        self.total = total
        self.share = share
        self.default = total.share(share)
        self.used = Usage()
        self._tenants: dict[str, Usage] = {}
        self._on_held = on_held
        self._on_refused = on_refused

    def limits(self, tenant: Tenant) -> Limits:
        """The tenant's limits: its share of the replica's, or the tokens file's."""
        return self.total if tenant.whole else self.default.updated(tenant.limits)

    def usage(self, tenant: Tenant) -> Usage:
        """What the tenant holds now (a copy)."""
        held = self._tenants.get(tenant.key)
        return Usage(**vars(held)) if held is not None else Usage()

    def check(self, tenant: Tenant, resource: Resource, amount: int = 1, own: int = 0) -> None:
        """Raise :class:`Refusal` when taking ``amount`` of ``resource`` would pass the
        replica's limit or the tenant's. Bytes are a lone request's whatever their number
        (``ADV_MAX_BODY_BYTES`` bounds it): when the replica holds no bytes but the ``own``
        bytes of the request that asks, the replica's budget does not refuse them; when the
        tenant holds none but those, the tenant's does not."""
        held = self._tenants.get(tenant.key) or Usage()
        total = self.total.of(resource)
        used = getattr(self.used, resource)
        lone = resource == "bytes" and used == own
        if used + amount > total and not lone:
            self._refuse(
                tenant,
                resource,
                f"the service holds {used} {_NOUN[resource]}"
                + (f"; {amount} more would pass" if resource == "bytes" else ", at")
                + f" its limit of {total} ({SETTING[resource]})",
            )
        limit = self.limits(tenant).of(resource)
        mine = getattr(held, resource)
        if mine + amount > limit and not (resource == "bytes" and mine == own):
            self._refuse(
                tenant,
                resource,
                f"{tenant.label!r} holds {mine} {_NOUN[resource]}"
                + (f"; {amount} more would pass" if resource == "bytes" else ", at")
                + f" its limit of {limit} (a tenant's share of {SETTING[resource]}: "
                "ADV_TENANT_SHARE, or the tokens file's limits)",
            )

    def _refuse(self, tenant: Tenant, resource: Resource, message: str) -> None:
        if self._on_refused is not None:
            self._on_refused(tenant.label, resource)
        raise Refusal(message, resource, tenant)

    def take(self, tenant: Tenant, resource: Resource, amount: int = 1, own: int = 0) -> None:
        """:meth:`check`, then hold ``amount`` of ``resource`` for the tenant."""
        self.check(tenant, resource, amount, own)
        self.add(tenant, resource, amount)

    def add(self, tenant: Tenant, resource: Resource, amount: int) -> None:
        """Hold (or with a negative ``amount``, give back) without a check: for what is
        already held under another resource's check, and for giving back."""
        if not amount:
            return
        held = self._tenants.get(tenant.key)
        if held is None:
            held = self._tenants[tenant.key] = Usage()
        setattr(held, resource, getattr(held, resource) + amount)
        setattr(self.used, resource, getattr(self.used, resource) + amount)
        if held.empty:
            del self._tenants[tenant.key]
        if self._on_held is not None:
            self._on_held(tenant.label, resource, amount)

    def give(self, tenant: Tenant, resource: Resource, amount: int = 1) -> None:
        self.add(tenant, resource, -amount)

    @property
    def tenants(self) -> int:
        """Tenants holding something now."""
        return len(self._tenants)


__all__ = ["RESOURCES", "Budget", "Limits", "Refusal", "Resource", "Tenant", "Usage"]
