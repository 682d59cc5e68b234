# The OpenAI-compatible HTTP gateway (services/gateway): torch-free, like the router.
#   docker build -f deploy/docker/gateway.Dockerfile -t bitdelta/gateway .
# Stages and BASE_IMAGE as in router.Dockerfile.
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
RUN /opt/venv/bin/pip install -q "starlette>=1.10,<2" "uvicorn>=0.54,<1" "jinja2>=3.1,<4" "llguidance==1.9.1"
WORKDIR /app
COPY protos protos
COPY bitdelta bitdelta
COPY services/__init__.py services/__init__.py
COPY services/gateway services/gateway
RUN /opt/protoc/bin/python -m bitdelta.protos_build --force && rm -r protos bitdelta/.protos-stamp

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PORT=8000
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
USER 10001
EXPOSE 8000
# Plain HTTP or, with --https-cert, HTTPS on 127.0.0.1:$PORT (the probe does not verify the certificate:
# it asks its own process). With --https-client-ca no anonymous probe can get an answer: override it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, ssl, urllib.request as u\nfor s in ('http', 'https'):\n    try:\n        u.urlopen(f'{s}://127.0.0.1:{os.environ[\"PORT\"]}/health', timeout=2, context=ssl._create_unverified_context()); break\n    except Exception as e:\n        err = e\nelse:\n    raise SystemExit(err)"]
ENTRYPOINT ["python", "-m", "services.gateway"]
CMD ["--address", "0.0.0.0:8000"]
