"""gRPC channel credentials for the TLS tests, from certificates `bitdelta.rpc.certs.make_all` wrote."""

from __future__ import annotations

from pathlib import Path

import grpc


def creds(certs: Path, who: str | None = "client", ca: Path | None = None) -> grpc.ChannelCredentials:
    """Verify the server against `ca` (default ours); present `who`'s certificate (None: none)."""
    root = (ca or certs / "ca.pem").read_bytes()
    if who is None:
        return grpc.ssl_channel_credentials(root)
    d = certs / "other" if who == "other" else certs  # "other": the client certificate of the second CA
    return grpc.ssl_channel_credentials(root, (d / "client.key").read_bytes(), (d / "client.pem").read_bytes())
