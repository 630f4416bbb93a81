# One image for every LeMix service; the command picks the service:
#   python -m gateway | services.scheduler | services.executor | profiler
#
#   docker build -t lemix:gpu .                          # CUDA torch (executors on GPUs)
#   docker build --build-arg VARIANT=cpu -t lemix:cpu .  # CPU torch
#
# Both variants start from BASE_IMAGE (a Debian-based Python 3.11 by default):
# torch's CUDA wheels bring their own CUDA libraries, so the GPU variant needs
# no CUDA base image, only the NVIDIA container toolkit on the host.
#
# Stages: os (an interpreter) -> build (a venv: torch, the dependencies, the
# project) -> runtime (the venv and the shipped profiles, a non-root user).
# Written for the classic builder too (no BuildKit, no buildx, no `# syntax=`
# line, no RUN --mount, no heredocs), which builds every stage it reads.
#
# Without Docker Hub, build the base locally and pass it:
# scripts/docker_engine.sh makes local/python:3.11, then
#   docker build --build-arg VARIANT=cpu --build-arg BASE_IMAGE=local/python:3.11 -t lemix:cpu .
# A torch wheel in docker-wheels/ is installed instead of asking the torch
# index (that is how CI puts its local CPU build in the image).

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ------------------------------------------------------------------ interpreter
FROM ${BASE_IMAGE} AS os
# A base without python3 >= 3.11 and its venv module (e.g. an Ubuntu or CUDA
# image) gets the distribution's; the default base already has both.
RUN if ! python3 -c 'import sys, venv; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# ------------------------------------------------------------------ the venv
FROM os AS build
ARG VARIANT=gpu
ARG TORCH_SPEC="torch>=2.4"
# Empty: the PyTorch index for VARIANT (cpu, or cu126 for gpu).
ARG TORCH_INDEX_URL=
# docker-wheels/ holds only a README unless a torch wheel was put there; then
# that file is installed (its dependencies from PyPI) and the index is not asked.
COPY docker-wheels/ /tmp/wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
      /opt/venv/bin/pip install --no-cache-dir /tmp/wheels/torch-*.whl; \
    else \
      case "${VARIANT}" in cpu) flavour=cpu ;; gpu) flavour=cu126 ;; \
        *) echo "VARIANT must be cpu or gpu, got ${VARIANT}" >&2; exit 1 ;; esac; \
      /opt/venv/bin/pip install --no-cache-dir \
        --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${flavour}}" "${TORCH_SPEC}"; \
    fi \
 && rm -rf /tmp/wheels
WORKDIR /src
# The dependencies first, read from pyproject.toml alone, so a source change
# rebuilds only the last layer (torch is already satisfied).
COPY pyproject.toml ./
RUN /opt/venv/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" >/tmp/requirements.txt \
 && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt
# Sources only (see .dockerignore); README.md is the package's long description.
COPY README.md ./
COPY lemix ./lemix
COPY services ./services
COPY gateway ./gateway
COPY profiler ./profiler
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps .

# ------------------------------------------------------------------ runtime
FROM os AS runtime
ARG VARIANT=gpu
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
# NVIDIA_*: what the NVIDIA container toolkit keys on (ignored without it).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/app/.cache/huggingface \
    LEMIX_IMAGE_VARIANT=${VARIANT} \
    LEMIX_PROFILE=/app/profiles/a100-llama2-7b-2stage.json \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# Gateway gRPC and HTTP; the other services' ports stay inside the stack.
EXPOSE 50051 8000
CMD ["lemix", "--help"]
