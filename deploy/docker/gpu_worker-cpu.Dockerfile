# The worker on CPU (development, small models): the CPU-only torch wheel. Its C kernels
# (bitdelta_kernels/csrc) are compiled in the build stage, which has gcc, for fixed targets: AVX-512
# (-march=x86-64-v4), AVX2 (-march=x86-64-v3) and portable (x86-64), by
# `python -m bitdelta_kernels.cpu_build --prebuild` into /opt/bitdelta-kernels. The runtime stage has no
# compiler: BITDELTA_KERNELS_PREBUILT_DIR points there, and the worker loads the best of them the
# CPU it runs on has the flags for (/proc/cpuinfo); it logs which at its first kernel call.
#   docker build -f deploy/docker/gpu_worker-cpu.Dockerfile -t bitdelta/worker:cpu .
# Stages, BASE_IMAGE and TORCH_INDEX_URL as in delta_store.Dockerfile (the same first layers, so
# the two share them).
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
RUN /opt/venv/bin/pip install -q "numpy>=1.26" "safetensors>=0.6" "tokenizers>=0.21" "tqdm>=4.66" "llguidance==1.9.1"
WORKDIR /app
COPY protos protos
COPY bitdelta bitdelta
COPY bitdelta_kernels bitdelta_kernels
COPY services/__init__.py services/__init__.py
COPY services/gpu_worker services/gpu_worker
COPY deploy/docker/healthcheck.py healthcheck.py
RUN /opt/protoc/bin/python -m bitdelta.protos_build --force && rm -r protos bitdelta/.protos-stamp
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
 && /opt/venv/bin/python -m bitdelta_kernels.cpu_build --prebuild /opt/bitdelta-kernels --isa avx512bf16 --isa avx512 --isa avx2 --isa scalar

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PORT=50061 BITDELTA_KERNEL_BACKEND=cpu \
    BITDELTA_KERNELS_PREBUILT_DIR=/opt/bitdelta-kernels
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta \
 && mkdir -p /models && chown bitdelta /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/bitdelta-kernels /opt/bitdelta-kernels
COPY --from=build /app /app
WORKDIR /app
USER 10001
EXPOSE 50061 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "services.gpu_worker"]
CMD ["--address", "[::]:50061", "--base", "/models/base", "--device", "cpu", "--metrics-address", "0.0.0.0:9400"]
