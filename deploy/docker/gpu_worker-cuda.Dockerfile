# The worker on NVIDIA GPUs: the official PyTorch CUDA runtime image (torch and CUDA libraries
# included; the code also runs on its torch 2.11 / triton 3.6, see docs/architecture.md "Pins").
#   docker build -f deploy/docker/gpu_worker-cuda.Dockerfile -t bitdelta/worker:cuda .
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PORT=50061 \
    TRITON_CACHE_DIR=/tmp/triton
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta \
 && mkdir -p /models && chown bitdelta /models
WORKDIR /app
COPY deploy/docker/requirements-rpc.txt /tmp/requirements-rpc.txt
RUN pip install -r /tmp/requirements-rpc.txt "numpy>=1.26" "safetensors>=0.6" "tokenizers>=0.21" "tqdm>=4.66" "llguidance==1.9.1"
COPY protos protos
COPY bitdelta bitdelta
COPY bitdelta_kernels bitdelta_kernels
COPY services/__init__.py services/__init__.py
COPY services/gpu_worker services/gpu_worker
COPY deploy/docker/healthcheck.py healthcheck.py
RUN python -m bitdelta.protos_build && chown -R bitdelta /app
USER 10001
EXPOSE 50061 9400
# start-period: the base loads and every Triton kernel binary is compiled before SERVING
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "services.gpu_worker"]
CMD ["--address", "[::]:50061", "--base", "/models/base", "--device", "cuda", "--metrics-address", "0.0.0.0:9400"]
