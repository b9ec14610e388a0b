"""CPU/CUDA agreement for every preset and a composition (skipped without a CUDA device)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from advantage_service import compute, compute_batch
from oracle import ALL_PRESETS, random_request

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

ESTIMATORS = [
    *ALL_PRESETS,
    {"outcome": "rloo", "ktae": {}, "cscr": {}, "opsd": {"clip": 0.5}, "whiten": True},
    {"outcome": "otb", "ktae": {}, "forking": {"scope": "group"}, "whiten": True},
]


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=str)
@pytest.mark.parametrize("seed", range(5))
def test_cuda_matches_cpu(estimator, seed):
    req = random_request(
        np.random.default_rng(seed),
        estimator=estimator,
        n_groups=(2, 6),
        group_size=(1, 16),
        length=(0, 64),
        vocab=40,
        is_weights=seed % 2 == 1,
    )
    cpu = compute(req, device="cpu")
    gpu = compute(req, device="cuda")
    assert gpu["summary"]["device"] == "cuda"
    for g_cpu, g_gpu in zip(cpu["groups"], gpu["groups"], strict=True):
        for r_cpu, r_gpu in zip(g_cpu["rollouts"], g_gpu["rollouts"], strict=True):
            for key in r_cpu:
                np.testing.assert_allclose(
                    r_gpu[key],
                    r_cpu[key],
                    rtol=1e-5,
                    atol=1e-5,
                    err_msg=f"{estimator} {g_cpu['id']} {key}",
                )


def test_cuda_matches_cpu_on_the_training_sized_batch():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from synthetic import training_batch

    batch = training_batch(teacher=True)
    spec = {"outcome": "grpo", "ktae": {}, "cscr": {}}
    cpu = compute_batch(batch, spec, "cpu")
    gpu = compute_batch(batch, spec, "cuda")
    assert gpu.advantages.device.type == "cuda"
    torch.testing.assert_close(gpu.advantages.cpu(), cpu.advantages, rtol=1e-5, atol=1e-5)


def test_cuda_matches_cpu_with_ktae_history():
    """History on the accelerator: the prior's lookup takes its batched-search path there, and
    the writes built from the device's result are the CPU's."""
    import asyncio

    from advantage_service.estimators import resolve_estimator
    from advantage_service.serving.compute import compute_request
    from advantage_service.serving.term_state import StateSession
    from advantage_service.stats import MemoryStatsStore
    from advantage_service.wire.request import ComputeRequest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from synthetic import training_batch

    spec = resolve_estimator({"outcome": "grpo", "ktae": {"history": "prompt"}})
    store = MemoryStatsStore()

    async def visit(seed: int, device: str):
        batch = training_batch(seed=seed, groups=8, max_len=512)
        req = ComputeRequest(batch, spec, f"visit-{seed}", "cuda")
        session = StateSession(store, req, torch.device(device))
        result = await asyncio.to_thread(compute_request, req, device, session.context)
        assert await session.settle() == "applied"
        return session, result

    for seed in range(3):
        cpu_session, cpu = asyncio.run(visit(seed, "cpu"))
        gpu_session, gpu = asyncio.run(visit(seed, "cuda"))
        assert gpu.advantages.device.type == "cuda"
        torch.testing.assert_close(gpu.advantages.cpu(), cpu.advantages, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            gpu.state["ktae"].score.cpu(), cpu.state["ktae"].score, rtol=1e-9, atol=1e-12
        )
        cpu_update, gpu_update = cpu_session.update(cpu), gpu_session.update(gpu)
        assert cpu_update.records == gpu_update.records
        np.testing.assert_allclose(
            gpu_update.tokens.key_sum, cpu_update.tokens.key_sum, rtol=1e-9, atol=1e-12
        )
        asyncio.run(cpu_session.record(cpu_update))
    assert len(cpu_update.records) == 8
