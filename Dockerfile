# syntax=docker/dockerfile:1
#
# advantage-service image.
#
#   docker build -t advantage-service:0.1.0-cpu .                          # CPU (default)
#   docker build -t advantage-service:0.1.0-cuda --build-arg DEVICE=cuda .  # CUDA
#
# DEVICE picks the runtime base image and the torch wheel index. The builder stage starts from
# the same base as the final one, so the virtual environment it fills runs unchanged there; the
# final stage gets the environment and nothing else (no compiler, no pip cache, no sources).

ARG DEVICE=cpu
# The CUDA variant's base and torch index go together: an older driver needs an older pair
# (e.g. nvidia/cuda:12.6.3-base-ubuntu24.04 with https://download.pytorch.org/whl/cu126).
ARG CUDA_BASE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu128

# ---- runtime bases, one per device -------------------------------------------------------------

FROM python:3.12-slim-bookworm AS runtime-cpu
ENV ADV_DEVICE=cpu \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# torch's CUDA wheels carry the CUDA libraries; the base only adds what the NVIDIA container
# runtime expects (driver capabilities) and a Python 3.12 from Ubuntu.
FROM ${CUDA_BASE} AS runtime-cuda
ARG TORCH_CUDA_INDEX_URL
ENV ADV_DEVICE=auto \
    TORCH_INDEX_URL=${TORCH_CUDA_INDEX_URL} \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Ubuntu's python3 is patched within its release; pinning the exact .deb would break every rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The stage named by DEVICE (hadolint cannot see through the variable to a stage name).
# hadolint ignore=DL3006
FROM runtime-${DEVICE} AS runtime

# ---- builder: a venv with torch for the device, then the service ----------------------------------

FROM runtime AS builder
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the device's index: its own layer, reused while only the service changes.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# The client package first: the service depends on it (it holds the gRPC code generated from
# proto/, committed, and the builder of flat batches), and no index serves it.
COPY clients/python ./clients/python
RUN pip install --no-cache-dir ./clients/python
COPY pyproject.toml README.md ./
COPY service ./service
RUN pip install --no-cache-dir . \
    && python -c "import advantage_service, torch; print(advantage_service.__version__, torch.__version__)"

# ---- final image --------------------------------------------------------------------------------

FROM runtime AS final
ARG DEVICE=cpu
LABEL org.opencontainers.image.title="advantage-service" \
      org.opencontainers.image.description="Model-free per-token advantage estimation service" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.advantage-service.device="${DEVICE}"
RUN groupadd --system --gid 10001 advantage \
    && useradd --system --uid 10001 --gid advantage --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin advantage
COPY --from=builder /opt/venv /opt/venv
# NUMBA_CACHE_DIR: the compiled CPU loops (estimators/kernels.py, gtpo_kernels.py) are cached
# under /tmp, the one writable place of a read-only root filesystem (the Deployment's emptyDir);
# a first start compiles them in about 7 s before it reports ready.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ADV_HOST=0.0.0.0 \
    ADV_HTTP_PORT=8000 \
    ADV_GRPC_PORT=50051 \
    NUMBA_CACHE_DIR=/tmp/numba-cache
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 50051
# /healthz answers while the process lives; readiness (/readyz) is the orchestrator's business.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('ADV_HTTP_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["advantage-service"]
CMD ["serve"]
