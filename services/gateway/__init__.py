"""The OpenAI-compatible HTTP gateway: a thin client of the router's gRPC API (docs/gateway.md)."""
