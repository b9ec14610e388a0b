#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA tests, the estimator benchmark on the GPU and the CPU,
# the stats-store benchmark on the GPU and dynamic batching (merged vs one-by-one computations of
# 32 small requests) on both, in one go. Run from the repository root after `make install` (with a CUDA build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
"$PY" -m pytest -q tests/test_cuda.py -p no:cacheprovider
"$PY" bench/bench_estimators.py --device cuda --skip-slow
"$PY" bench/bench_estimators.py --device cpu --skip-slow
# The stats store with the batch on the GPU: with a short compute, the history read sets the
# response time (needs redis-server on the PATH; skipped without it).
if command -v redis-server >/dev/null; then
  "$PY" bench/bench_stats.py --device cuda --visits 6 --repeats 3
fi
"$PY" bench/bench_merge.py --device cuda
"$PY" bench/bench_merge.py --device cpu
# The writer's update against the computation with the batch on the GPU (no Redis needed), and
# the verl adapter against verl's own GRPO on GPU tensors (when verl is installed).
"$PY" bench/bench_stats.py --writer --device cuda --visits 5 --repeats 5
if "$PY" -c "import verl" 2>/dev/null; then
  "$PY" bench/bench_trainers.py --device cuda --no-remote --repeats 11
fi
