# The OpenAI-compatible HTTP gateway (services/gateway): torch-free, like the router.
#   docker build -f deploy/docker/gateway.Dockerfile -t bitdelta/gateway .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bitdelta
WORKDIR /app
COPY deploy/docker/requirements-rpc.txt /tmp/requirements-rpc.txt
RUN pip install -r /tmp/requirements-rpc.txt "starlette>=1.10,<2" "uvicorn>=0.54,<1" "jinja2>=3.1,<4"
COPY protos protos
COPY bitdelta bitdelta
COPY services/__init__.py services/__init__.py
COPY services/gateway services/gateway
RUN python -m bitdelta.protos_build && chown -R bitdelta /app/bitdelta
USER 10001
EXPOSE 8000
# Plain HTTP or, with --https-cert, HTTPS (the probe does not verify the certificate: it asks its own
# process). With --https-client-ca no anonymous probe can get an answer: override the health check.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import ssl, urllib.request as u\nfor url in ('http://127.0.0.1:8000/health', 'https://127.0.0.1:8000/health'):\n    try:\n        u.urlopen(url, timeout=2, context=ssl._create_unverified_context()); break\n    except Exception as e:\n        err = e\nelse:\n    raise SystemExit(err)"]
ENTRYPOINT ["python", "-m", "services.gateway"]
CMD ["--address", "0.0.0.0:8000"]
