"""A real service process for the trainer tests, and its request counter."""

from __future__ import annotations

from service_support import Service


class TrainerService(Service):
    """``advantage-service serve`` with an HTTP port (``url``) and a gRPC port (``target``),
    counting the requests it answered."""

    def requests(self, transport: str | None = None, estimator: str | None = None) -> float:
        """advantage_requests_total answered 200, summed over the labels not given."""
        total = 0.0
        for (name, labels), value in self.metrics().items():
            if name != "advantage_requests_total":
                continue
            found = dict(labels)
            if found.get("code") != "200":
                continue
            # (HTTP's label says the body format: http_arrow, http_json)
            if transport is not None and not found.get("transport", "").startswith(transport):
                continue
            if estimator is not None and found.get("estimator") != estimator:
                continue
            total += value
        return total
