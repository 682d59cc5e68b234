# The delta store: streams delta files from a volume (local backend) or S3. Its delta-format
# reader uses torch's dtypes, so the CPU-only torch wheel goes in (no CUDA libraries).
#   docker build -f deploy/docker/delta_store.Dockerfile -t bitdelta/delta-store .
# Stages and BASE_IMAGE as in router.Dockerfile. TORCH_INDEX_URL: where the CPU wheel comes from
# (empty: pip's own settings, e.g. a PIP_FIND_LINKS that holds it).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY deploy/docker/requirements-build.txt deploy/docker/requirements-rpc.txt /tmp/
RUN python -m venv /opt/protoc && /opt/protoc/bin/pip install -q -r /tmp/requirements-build.txt \
 && python -m venv /opt/venv && /opt/venv/bin/pip install -q -r /tmp/requirements-rpc.txt
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN /opt/venv/bin/pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
RUN /opt/venv/bin/pip install -q "numpy>=1.26" "safetensors>=0.6" "boto3>=1.35" "tqdm>=4.66"
WORKDIR /app
COPY protos protos
COPY bitdelta bitdelta
COPY services/__init__.py services/__init__.py
COPY services/delta_store services/delta_store
COPY deploy/docker/healthcheck.py healthcheck.py
RUN /opt/protoc/bin/python -m bitdelta.protos_build --force && rm -r protos bitdelta/.protos-stamp

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PORT=50052
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta \
 && mkdir -p /deltas && chown bitdelta /deltas
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
USER 10001
VOLUME ["/deltas"]
EXPOSE 50052 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "services.delta_store"]
CMD ["--address", "[::]:50052", "--backend", "local", "--root", "/deltas", "--metrics-address", "0.0.0.0:9400"]
