# syntax=docker/dockerfile:1
# One image for every LeMix service; the command picks the service:
#   python -m gateway | services.scheduler | services.executor | profiler
#
#   docker build -t lemix:gpu .                          # CUDA base + CUDA torch (executors)
#   docker build --build-arg VARIANT=cpu -t lemix:cpu .  # slim Python + CPU torch
#
# Stages: os-{cpu,gpu} (an interpreter) → torch-{cpu,gpu} (a venv holding the
# matching torch wheel) → build (the project, `pip install .`) → runtime
# (the venv and the shipped profiles, a non-root user). Only the VARIANT's
# stages are built.

ARG VARIANT=gpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Torch's CUDA wheels bring their own CUDA libraries; the base adds what the
# NVIDIA container toolkit keys on (NVIDIA_VISIBLE_DEVICES, driver capabilities).
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04

# ------------------------------------------------------------------ interpreters
FROM ${PYTHON_IMAGE} AS os-cpu

FROM ${CUDA_IMAGE} AS os-gpu
# Ubuntu 24.04's python3 is 3.12 (pyproject needs >= 3.11).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# ------------------------------------------------------------------ torch, per variant
FROM os-cpu AS torch-cpu
ARG TORCH_SPEC="torch>=2.4"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

FROM os-gpu AS torch-gpu
ARG TORCH_SPEC="torch>=2.4"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# ------------------------------------------------------------------ the project
FROM torch-${VARIANT} AS build
WORKDIR /src
# Sources only (see .dockerignore): torch is already satisfied, so this layer
# adds the project's other dependencies from PyPI and the project itself.
COPY pyproject.toml README.md ./
COPY lemix ./lemix
COPY services ./services
COPY gateway ./gateway
COPY profiler ./profiler
RUN /opt/venv/bin/pip install --no-cache-dir .

# ------------------------------------------------------------------ runtime
FROM os-${VARIANT} AS runtime
ARG VARIANT
# The weight-sync dir (LEMIX_WEIGHT_SYNC_DIR) exists, owned by lemix, so a fresh
# volume mounted on it (compose's lemix-weights) is writable by the executors.
RUN groupadd --system --gid 10001 lemix \
 && useradd --system --uid 10001 --gid lemix --home-dir /app --create-home lemix \
 && install -d -o 10001 -g 10001 /var/lib/lemix/weights
COPY --from=build /opt/venv /opt/venv
COPY --chown=10001:10001 profiles /app/profiles
WORKDIR /app
# `pip install .` leaves profiles/ out of the venv: LEMIX_PROFILE points every
# service at the shipped two-stage profile (override it per deployment).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/app/.cache/huggingface \
    LEMIX_IMAGE_VARIANT=${VARIANT} \
    LEMIX_PROFILE=/app/profiles/a100-llama2-7b-2stage.json
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# Gateway gRPC and HTTP; the other services' ports stay inside the stack.
EXPOSE 50051 8000
CMD ["lemix", "--help"]
