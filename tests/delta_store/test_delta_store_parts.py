"""The delta store describes a delta beyond one sign plane (format v3) like any other: every
plane's signs and scales by their roles, the low-rank factors as TENSOR_ROLE_LOWRANK, and the
byte counts of each role (the worker refuses to serve it: tests/gpu_worker/test_worker_loader.py)."""

from __future__ import annotations

from bitdelta.compress import compress
from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.format import read_header
from bitdelta.planes import PlaneConfig
from bitdelta.testing.family import make_base, make_finetune
from services.delta_store.store import StoredDelta


def test_a_v3_delta_is_described_by_role(tmp_path):
    base = make_base(tmp_path / "base")
    ft = make_finetune(base, tmp_path / "ft", seed=3)
    path = compress(base, ft, tmp_path / "d.st", planes=PlaneConfig(planes=2, rank=4, rank_step=4), progress=False)
    h = read_header(path)
    d = StoredDelta("d", path.stat().st_size, "1", h)
    info = d.info_proto()
    assert info.format_version == "3"
    roles = h.bytes_by_role()
    assert (info.sign_bytes, info.alpha_bytes, info.dense_bytes) == (roles["sign"], roles["alpha"], roles["dense"])
    by_role = {}
    for t in d.tensors_proto():
        by_role.setdefault(t.role, []).append(t.name)
    assert any(n.endswith(".sign2") for n in by_role[pb.TENSOR_ROLE_SIGN])
    assert any(n.endswith(".alpha2") for n in by_role[pb.TENSOR_ROLE_ALPHA])
    assert sorted(n.rsplit(".", 1)[1] for n in by_role[pb.TENSOR_ROLE_LOWRANK])[:2] == ["lowrank_u", "lowrank_u"]
