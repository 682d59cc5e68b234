# The router: torch-free (it never touches weights), so a slim Python image.
#   docker build -f deploy/docker/router.Dockerfile -t bitdelta/router .
# Every service image has two stages: `build` makes the virtual environment (/opt/venv) and the
# generated gRPC code (protoc from grpcio-tools, which stays in that stage); the runtime stage copies
# both onto a clean base. BASE_IMAGE: any Debian-like image whose `python` is CPython 3.11 (the
# default is the official one; scripts/deploy-test.sh makes one from Debian's packages where no
# registry is reachable, and passes the PIP_* settings of that machine).
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
WORKDIR /app
COPY protos protos
COPY bitdelta bitdelta
COPY services/__init__.py services/__init__.py
COPY services/router services/router
COPY deploy/docker/healthcheck.py healthcheck.py
RUN /opt/protoc/bin/python -m bitdelta.protos_build --force && rm -r protos bitdelta/.protos-stamp

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PORT=50051
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
USER 10001
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "services.router"]
CMD ["--address", "[::]:50051", "--metrics-address", "0.0.0.0:9400"]
