# The delta store: streams delta files from a volume (local backend) or S3. Its delta-format
# reader uses torch's dtypes, so the CPU-only torch wheel goes in (no CUDA libraries).
#   docker build -f deploy/docker/delta_store.Dockerfile -t bitdelta/delta-store .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PORT=50052
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta \
 && mkdir -p /deltas && chown bitdelta /deltas
WORKDIR /app
COPY deploy/docker/requirements-rpc.txt /tmp/requirements-rpc.txt
RUN pip install -r /tmp/requirements-rpc.txt "numpy>=1.26" "safetensors>=0.6" "boto3>=1.35" "tqdm>=4.66" \
 && pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY protos protos
COPY bitdelta bitdelta
COPY services/__init__.py services/__init__.py
COPY services/delta_store services/delta_store
COPY deploy/docker/healthcheck.py healthcheck.py
RUN python -m bitdelta.protos_build && chown -R bitdelta /app/bitdelta
USER 10001
VOLUME ["/deltas"]
EXPOSE 50052 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "services.delta_store"]
CMD ["--address", "[::]:50052", "--backend", "local", "--root", "/deltas", "--metrics-address", "0.0.0.0:9400"]
