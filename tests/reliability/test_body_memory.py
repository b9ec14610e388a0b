"""What reading a large body costs a real service process: its peak RSS (VmHWM, reset before
each request) grows by about the body's bytes once, for a body read whole at the limit, and
stays bounded by the limit, or flat, for bodies refused over it. (Before, the body was kept as
a list of chunks and joined: twice its bytes at the join.)"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from body_support import MiB, peak_rss, post_body, reset_peak_rss
from support import Service

pytestmark = pytest.mark.integration

ARROW = "application/vnd.apache.arrow.stream"
# What the rest of the process may add while it answers (the decoder's error, the answer, the
# allocator's slack): the "+ 16 MiB".
SLACK = 16 * MiB


@pytest.fixture
def service(service_factory: Callable[..., Service]) -> Service:
    return service_factory(max_body_bytes=128 * MiB)


def test_a_body_read_whole_at_the_limit_costs_its_bytes_once(service: Service) -> None:
    """128 MiB at the limit, declared by Content-Length, that is no Arrow stream: read whole,
    then refused 422 by the decoder at its first bytes, so the growth is the body's buffer."""
    size = 128 * MiB
    before = reset_peak_rss(service.proc.pid)
    status, _, body = post_body(
        service.http_port, "/v1/advantages", size, fill=b"\0", headers={"Content-Type": ARROW}
    )
    growth = peak_rss(service.proc.pid) - before
    assert status == 422 and json.loads(body)["error"]["code"] == "invalid_arrow", body
    assert growth <= 1.1 * size + SLACK, f"{growth / MiB:.0f} MiB for a {size / MiB:.0f} MiB body"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_ten_times_the_limit_is_refused_within_the_limit(
    service: Service, chunked: bool
) -> None:
    """1.25 GiB, 10x the limit: by Content-Length refused before a byte is kept; chunked,
    refused once the limit is passed, having held at most the limit (the buffer grows by an
    eighth at a time)."""
    limit = 128 * MiB
    before = reset_peak_rss(service.proc.pid)
    status, headers, body = post_body(
        service.http_port, "/v1/advantages", 10 * limit, chunked=chunked
    )
    growth = peak_rss(service.proc.pid) - before
    error = json.loads(body)["error"]
    assert status == 413 and (error["code"], error["field"]) == ("limit_exceeded", "body")
    assert headers["connection"] == "close"
    bound = 1.125 * limit + SLACK if chunked else SLACK
    assert growth <= bound, f"{growth / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
