# Prometheus from Debian's package, for a machine without an image registry (the user-facing
# compose file runs the official image). deploy/local/docker-compose.local.yml runs it.
#   docker build -f deploy/local/prometheus.Dockerfile -t bitdelta/prometheus:local .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --shell /usr/sbin/nologin bitdelta && mkdir /prometheus && chown bitdelta /prometheus
USER 10001
ENV PORT=9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen(f'http://127.0.0.1:{os.environ[\"PORT\"]}/-/ready', timeout=2)"]
ENTRYPOINT ["prometheus", "--storage.tsdb.path=/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
