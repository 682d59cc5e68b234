# The OTLP collector of the stack on a machine without an image registry: rotel (PyPI), whose
# wheel carries one static binary. deploy/local/docker-compose.local.yml runs it in Jaeger's place.
#   docker build -f deploy/local/rotel.Dockerfile -t bitdelta/rotel:local .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
RUN python -m venv /opt/rotel && /opt/rotel/bin/pip install -q --no-cache-dir "rotel==0.0.1a15"

FROM ${BASE_IMAGE}
COPY --from=build /opt/rotel/lib/python3.11/site-packages/rotel/rotel-agent /usr/local/bin/rotel-agent
RUN useradd --uid 10001 --shell /usr/sbin/nologin rotel
USER 10001
ENV PORT=4317
# up when its OTLP/gRPC port accepts connections (rotel has no health endpoint)
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, socket; socket.create_connection(('127.0.0.1', int(os.environ['PORT'])), 2)"]
ENTRYPOINT ["rotel-agent", "start"]
