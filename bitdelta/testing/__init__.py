"""Helpers used by tests and bench/ (and scripts/trace_report.py): tiny random model families
(`family`), the whole system as processes on loopback (`cluster`), and the real model's
cached test deltas (`real`, also scripts/deploy_check.py's family). They live in the core
once because bench/ runs them outside pytest; what only the tests use is in tests/support/.
"""
