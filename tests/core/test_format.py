"""Bad delta files (bitdelta.format): a flipped bit is found and its tensor named, a truncated file
and a garbage header are refused, a delta for another base is refused; by the library and the CLI."""

from __future__ import annotations

import shutil

import pytest

from bitdelta.checkpoint import fingerprint
from bitdelta.compress import apply
from bitdelta.format import BaseMismatchError, DeltaFormatError, load_delta, read_header, verify
from bitdelta.testing.family import make_base
from tests.support.cli import run_cli


def test_verify_detects_bit_flip_and_names_tensor(delta_file, tmp_path):
    bad = tmp_path / "flip.safetensors"
    shutil.copy(delta_file, bad)
    h = read_header(bad)
    target = next(t for t in h.tensors if t.role == "sign")
    raw = bytearray(bad.read_bytes())
    raw[target.start + 3] ^= 0x10
    bad.write_bytes(bytes(raw))
    with pytest.raises(DeltaFormatError, match="sha256 mismatch") as e:
        verify(bad)
    assert e.value.tensor == target.name
    code, out = run_cli("verify", str(bad))
    assert code != 0 and target.name in out


def test_truncated_file_is_rejected(delta_file, tmp_path):
    bad = tmp_path / "trunc.safetensors"
    data = delta_file.read_bytes()
    h = read_header(delta_file)
    bad.write_bytes(data[: h.tensors[-1].start + 5])
    with pytest.raises(DeltaFormatError, match="truncated"):
        load_delta(bad)
    code, out = run_cli("verify", str(bad))
    assert code != 0 and "truncated" in out and h.tensors[-1].name in out
    (tmp_path / "tiny").write_bytes(data[:5])
    code, out = run_cli("inspect", str(tmp_path / "tiny"))
    assert code != 0 and "truncated" in out


def test_garbage_header_is_rejected(tmp_path):
    bad = tmp_path / "junk.safetensors"
    bad.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}" + b"\0" * 10)
    with pytest.raises(DeltaFormatError, match="JSON"):
        read_header(bad)


def test_wrong_base_is_refused(family, delta_file, tmp_path):
    base, (_, v1) = family
    other_base = make_base(tmp_path / "other", seed=42)
    with pytest.raises(BaseMismatchError, match="built for base"):
        load_delta(delta_file, base_fingerprint=fingerprint(other_base))
    with pytest.raises(BaseMismatchError):
        apply(other_base, delta_file, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    code, out = run_cli("verify", str(delta_file), "--base", str(other_base))
    assert code != 0 and "fingerprint" in out
    code, out = run_cli("apply", "--base", str(other_base), "--delta", str(delta_file), "--out", str(tmp_path / "o2"))
    assert code != 0 and "built for base" in out


@pytest.mark.parametrize("bad", ["[]", "[-1]", "[1.5]", '"x"', "[true]", "7"])
def test_malformed_eos_token_ids_are_refused(bad):
    from bitdelta.format import DeltaMeta

    meta = DeltaMeta("v", "b", "f", "row", "llama", "q,k,v,o,gate,up,down", eos_token_ids=(3, 9))
    strings = meta.to_strings()
    assert DeltaMeta.from_strings(strings).eos_token_ids == (3, 9)
    with pytest.raises(DeltaFormatError, match="eos_token_ids"):
        DeltaMeta.from_strings({**strings, "eos_token_ids": bad})
