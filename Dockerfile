# gpu-sidecar: multi-stage image on a slim glibc Python (NVML is a glibc library that the NVIDIA
# container runtime injects at start; musl images cannot load it).

FROM python:3.12-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
# python3, not python: the name every Debian-based Python has (python:*-slim has both)
RUN python3 -m venv /opt/gpu-sidecar \
 && /opt/gpu-sidecar/bin/pip install --no-cache-dir --upgrade pip==24.3.1 \
 && /opt/gpu-sidecar/bin/pip install --no-cache-dir .

FROM python:3.12-slim-bookworm
COPY --from=build /opt/gpu-sidecar /opt/gpu-sidecar
RUN groupadd --system --gid 65532 gpu-sidecar \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin gpu-sidecar \
 && mkdir -p /run/gpu-sidecar /var/lib/gpu-sidecar/spool \
 && chown -R 65532:65532 /run/gpu-sidecar /var/lib/gpu-sidecar
# Only the management library is needed: never the compute stack. Which GPUs the container sees
# is the pod's business (NVIDIA_VISIBLE_DEVICES is deliberately not set here; see k8s/).
ENV PATH=/opt/gpu-sidecar/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_DRIVER_CAPABILITIES=utility
USER 65532:65532
VOLUME ["/run/gpu-sidecar", "/var/lib/gpu-sidecar/spool"]
# exec form: the agent is PID 1 and receives SIGTERM itself (last sample, flush, exit 0).
# No HEALTHCHECK: Kubernetes ignores it; the pod uses a startupProbe on the socket instead.
ENTRYPOINT ["gpu-sidecar", "run"]
