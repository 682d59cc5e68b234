"""The delta store: owns the delta files and streams them to GPU workers.

    python -m services.delta_store --root /var/lib/bitdelta/deltas
    python -m services.delta_store --backend s3 --s3-endpoint http://127.0.0.1:8080 --s3-bucket deltas

Layers (each its own module): `config` (flags + env), `backends` (local
filesystem, S3; one interface), `cache` (host-memory entries, single-flight
loads; policy in `bitdelta.cache_policy`), `store` (the core: verification,
List/Stat/Fetch/Put/Delete), `server` (gRPC: servicer, error interceptor,
health, reflection, drain), `client` (the async client GPU workers use).
See docs/delta-store.md.
"""
