"""A write that one master of a real Redis Cluster missed (stopped past the write's timeout while
the others took their parts) is made again by the service's writer and counted once: the parts
that were applied are found claimed and left, the missing ones applied (docs/reliability.md,
"Statistics")."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from redis_cluster_support import LocalCluster
from serving.test_stats_writer import (
    NS,
    ROLLOUTS,
    compute,
    gated_engine,
    outcomes,
    rollouts_counted,
    store_errors,
)

pytestmark = [pytest.mark.integration]


def test_a_cluster_write_one_master_missed_is_made_again_and_counted_once(
    redis_cluster: LocalCluster,
) -> None:
    async def scenario() -> None:
        engine, store = gated_engine(redis_cluster.url)
        store.gate.set()
        try:
            # The prompts' history written first, so that the request below writes records to
            # their slots as well as its statistics to its bucket.
            assert (await compute(engine, 1, request_id="before")).summary["recorded"]
            assert await engine.settle_writes(10) == 0
            rid = "one-master-missed"
            layout = store._layout.chosen  # (where this request's statistics live)
            port = redis_cluster.master_of(layout.bucket_slot(NS, layout.bucket_of(rid)))
            process = redis_cluster.nodes[port].process
            assert process is not None
            store.gate.clear()
            answer = await compute(engine, 1, request_id=rid)
            assert answer.summary["recorded"] is True
            assert answer.summary["history"] == "applied"
            # Stopped for less than the cluster's node timeout (1 s): no failover, only the
            # write's 0.3 s timeout is missed.
            os.kill(process.pid, signal.SIGSTOP)
            try:
                store.gate.set()
                await asyncio.sleep(0.8)
                assert engine.writer.backlog == 1  # not given up
            finally:
                os.kill(process.pid, signal.SIGCONT)
            assert await engine.settle_writes(20) == 0
            assert store_errors(engine).get("record", 0) >= 1  # (a part did time out)
            assert await rollouts_counted(store) == 2 * ROLLOUTS
            assert outcomes(engine) in ({"counted": 2.0}, {"counted": 1.0, "duplicate": 1.0})
        finally:
            engine.close()
            await store.close()

    asyncio.run(scenario())
