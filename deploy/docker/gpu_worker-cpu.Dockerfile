# The worker on CPU (development, small models): the CPU-only torch wheel and a C compiler for
# the compiled CPU kernels (kernels/csrc, built on first use).
#   docker build -f deploy/docker/gpu_worker-cpu.Dockerfile -t bitdelta/worker:cpu .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PORT=50061 \
    BITDELTA_KERNEL_BACKEND=cpu
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta \
 && mkdir -p /models && chown bitdelta /models
WORKDIR /app
COPY deploy/docker/requirements-rpc.txt /tmp/requirements-rpc.txt
RUN pip install -r /tmp/requirements-rpc.txt "numpy>=1.26" "safetensors>=0.6" "tokenizers>=0.21" "tqdm>=4.66" \
 && pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY protos protos
COPY bitdelta bitdelta
COPY kernels kernels
COPY services/__init__.py services/__init__.py
COPY services/gpu_worker services/gpu_worker
COPY deploy/docker/healthcheck.py healthcheck.py
RUN python -m bitdelta.protos_build && chown -R bitdelta /app
USER 10001
EXPOSE 50061 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "services.gpu_worker"]
CMD ["--address", "[::]:50061", "--base", "/models/base", "--device", "cpu", "--metrics-address", "0.0.0.0:9400"]
