"""The OpenAI-compatible gateway (services/gateway/), over HTTP and HTTPS."""
