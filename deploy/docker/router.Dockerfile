# The router: torch-free (it never touches weights), so a slim Python image.
#   docker build -f deploy/docker/router.Dockerfile -t bitdelta/router .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PORT=50051
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta
WORKDIR /app
COPY deploy/docker/requirements-rpc.txt /tmp/requirements-rpc.txt
RUN pip install -r /tmp/requirements-rpc.txt
COPY protos protos
COPY bitdelta bitdelta
COPY services/__init__.py services/__init__.py
COPY services/router services/router
COPY deploy/docker/healthcheck.py healthcheck.py
# generated gRPC code (git-ignored in the repo), built with the pinned grpcio-tools
RUN python -m bitdelta.protos_build && chown -R bitdelta /app/bitdelta
USER 10001
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "services.router"]
CMD ["--address", "[::]:50051", "--metrics-address", "0.0.0.0:9400"]
