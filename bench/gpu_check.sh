#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA tests, then the estimator benchmark on the GPU and the
# CPU, in one go. Run from the repository root after `make install` (with a CUDA build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
"$PY" -m pytest -q tests/test_cuda.py -p no:cacheprovider
"$PY" bench/bench_estimators.py --device cuda --skip-slow
"$PY" bench/bench_estimators.py --device cpu --skip-slow
