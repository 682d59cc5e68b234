"""Helpers used by tests and bench/ (and scripts/trace_report.py): tiny random model families
(`family`) and the whole system as processes on loopback (`cluster`). They live in the core
once because bench/ runs them outside pytest; what only the tests use is in tests/support/.
"""
