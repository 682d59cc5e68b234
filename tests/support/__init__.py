"""What only the tests use: real servers as pytest plugins (`tests.support.swift`: OpenStack Swift
with the S3 API; `tests.support.delta_store`: delta files, backends under test, delta store
servers), the reliability suite's system and tally (`reliability`), kernel test cases
(`kernel_cases`), a worker on a loopback port (`worker`), a Prometheus scrape (`metrics`), the
`bitdelta` command as a user runs it (`cli`) and a tiny plain-checkpoint family (`family`).
Helpers that bench/ uses too live once in the core, in `bitdelta.testing`. Nothing outside tests/
imports this package (tests/test_architecture.py).

Test modules load the plugins with `pytest_plugins = ["tests.support.swift", "tests.support.delta_store"]`.
"""
