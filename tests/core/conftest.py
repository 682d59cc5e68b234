"""The core's tests share one tiny family (a base and two plain fine-tunes) and a delta of its
first variant, built once per module."""

import pytest

from bitdelta.compress import compress
from tests.support.family import make_tiny_family


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    base, variants = make_tiny_family(root, n_variants=2)
    return base, variants


@pytest.fixture(scope="module")
def delta_file(family, tmp_path_factory):
    base, (v0, _) = family
    return compress(base, v0, tmp_path_factory.mktemp("d") / "v0.safetensors", progress=False)
