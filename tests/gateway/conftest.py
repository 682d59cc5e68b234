"""The gateway's tests share a tiny random family (two variants, no corrupted delta), one per module."""

import os

import pytest

from bitdelta.testing.family import make_test_family


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    fam = make_test_family(tmp_path_factory.mktemp("gateway_family"), n_variants=2, merged=False)
    os.remove(fam.delta_path(fam.corrupt))
    return fam
