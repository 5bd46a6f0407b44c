# One image for every kvmesh service (and, in deploy/k8s, the bundled Valkey and SeaweedFS);
# docker-compose.yml and deploy/k8s pick the command.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=2
WORKDIR /app

# A C compiler for the engine's CPU kernels (kernels/cpu_library.py builds them for the
# machine it runs on, at first use; without one the engine takes the slower torch path).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# CPU torch first, from PyTorch's CPU index: the default wheel would pull CUDA (GBs).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# Dependencies change less often than code: install them in their own layer.
COPY pyproject.toml README.md ./
COPY kvmesh kvmesh
COPY services services
COPY kernels kernels
COPY launch launch
COPY training training
RUN pip install .
# The shipped trained models (the compose file's and deploy/k8s' engines load
# models/deepseek-v41-tiny by path: the installed package carries no models/).
COPY models models

# Run as an unprivileged user. Only the kvstore writes (its hot disk tier and metadata in
# /data, a named volume in docker-compose.yml that starts with this ownership).
RUN useradd --create-home --uid 10001 kvmesh && mkdir -p /data && chown kvmesh /data
USER kvmesh
ENTRYPOINT []
CMD ["kvmesh", "--help"]
