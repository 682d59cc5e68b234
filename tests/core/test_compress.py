"""Foundation: bit convention, model definition, delta format, compression round trip, CLI errors, protos."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bitdelta.checkpoint import CheckpointReader, fingerprint
from bitdelta.compress import apply, compress
from bitdelta.format import BaseMismatchError, DeltaFormatError, load_delta, read_header, verify
from bitdelta.model import BitDeltaLinear, attach_delta, load_model
from bitdelta.testing.family import make_base, make_finetune, tiny_args
from kernels.bits import pack_signs, unpack_signs
from tests.support.family import make_tiny_family

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    base, variants = make_tiny_family(root, n_variants=2)
    return base, variants


@pytest.fixture(scope="module")
def delta_file(family, tmp_path_factory):
    base, (v0, _) = family
    return compress(base, v0, tmp_path_factory.mktemp("d") / "v0.safetensors", progress=False)


# --- bits -------------------------------------------------------------------


@pytest.mark.parametrize("d_in", [8, 13, 64, 257])
def test_pack_matches_numpy_packbits_little(d_in):
    g = torch.Generator().manual_seed(d_in)
    delta = torch.randn(7, d_in, generator=g)
    delta[0, :5] = 0.0  # sign(0) = +1
    ours = pack_signs(delta).numpy()
    ref = np.packbits((delta >= 0).numpy(), axis=-1, bitorder="little")
    assert ours.shape == (7, (d_in + 7) // 8)
    np.testing.assert_array_equal(ours, ref)
    back = unpack_signs(torch.from_numpy(ref), d_in)
    expected = torch.where(delta >= 0, 1.0, -1.0)
    assert torch.equal(back, expected)


def test_unpack_rejects_wrong_width():
    with pytest.raises(ValueError, match="bytes per row"):
        unpack_signs(torch.zeros(2, 3, dtype=torch.uint8), d_in=30)


# --- model --------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_model_matches_transformers(tmp_path, tied):
    import transformers

    args = tiny_args(tie_embeddings=tied, n_kv_heads=2, n_heads=4)
    base = make_base(tmp_path / "m", args, seed=3)
    ours = load_model(base)
    theirs = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, args.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # The KV-cache path gives the same greedy continuation as full recomputation.
    prompt = ids[0, :5].tolist()
    gen = ours.generate(prompt, 8)
    seq = list(prompt)
    for _ in range(len(gen)):
        seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
    assert gen == seq[len(prompt) :]


def test_sharded_checkpoint_loads_like_single(tmp_path, family):
    base, _ = family
    with CheckpointReader(base) as r:
        state = dict(r)
    names = sorted(state)
    half = len(names) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    from safetensors.torch import save_file

    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / fname))
        weight_map.update({k: fname for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(base / "config.json", out / "config.json")
    ids = torch.arange(20).reshape(1, 20)
    assert torch.equal(load_model(out)(ids), load_model(base)(ids))


def test_bitdelta_linear_equals_merged_dense():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 27, generator=g)
    delta = torch.randn(40, 27, generator=g) * 0.01
    signs, alpha = pack_signs(delta), delta.abs().mean(1)
    lin = BitDeltaLinear(w, signs, alpha)
    x = torch.randn(3, 5, 27, generator=g)
    dense = w + alpha[:, None] * torch.where(delta >= 0, 1.0, -1.0)
    torch.testing.assert_close(lin(x), x @ dense.t(), atol=1e-5, rtol=1e-5)


# --- compression round trip -------------------------------------------------------


@pytest.mark.parametrize("alpha_mode", ["row", "matrix"])
def test_compress_apply_round_trip_is_exact(family, tmp_path, alpha_mode):
    base, (v0, _) = family
    out = compress(base, v0, tmp_path / "d.safetensors", alpha_mode=alpha_mode, progress=False)
    dense_dir = apply(base, out, tmp_path / "applied", progress=False)
    delta = load_delta(out)
    assert delta.compressed, "projections must be compressed"
    with CheckpointReader(base) as rb, CheckpointReader(v0) as rf, CheckpointReader(dense_dir) as ra:
        for name in rf.keys():
            w_base, w_ft, got = rb.get(name).float(), rf.get(name).float(), ra.get(name)
            if name in delta.compressed:
                d = w_ft - w_base
                s = torch.where(d >= 0, 1.0, -1.0)
                alpha = d.abs().mean(1, keepdim=True) if alpha_mode == "row" else d.abs().mean()
                assert torch.equal(got, w_base + alpha * s), name
            else:
                assert torch.equal(got, w_ft), name  # dense parts come back exactly
    # Every projection is compressed, nothing else is.
    projections = {n for n in delta.compressed}
    assert all(n.split(".")[-2].endswith("proj") for n in projections)
    assert len(projections) == 7 * tiny_args().n_layers


def test_compressed_embeddings_mode(family, tmp_path):
    base, (v0, _) = family
    out = compress(base, v0, tmp_path / "e.safetensors", embeddings="sign", progress=False)
    delta = load_delta(out)
    assert "model.embed_tokens.weight" in delta.compressed
    model = attach_delta(load_model(base), delta)
    dense = load_model(apply(base, out, tmp_path / "ea", progress=False))
    ids = torch.arange(30).reshape(2, 15)
    torch.testing.assert_close(model(ids), dense(ids), atol=1e-5, rtol=1e-4)


def test_attached_variant_matches_applied_checkpoint(family, delta_file, tmp_path):
    base, _ = family
    variant = attach_delta(load_model(base), load_delta(delta_file))
    dense = load_model(apply(base, delta_file, tmp_path / "a", progress=False))
    ids = torch.randint(0, 259, (2, 19), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(variant(ids), dense(ids), atol=1e-5, rtol=1e-4)


def test_unchanged_parameters_are_not_stored(family, tmp_path):
    base, _ = family
    ft = make_finetune(base, tmp_path / "ft", seed=5, touch_norms=False)
    h = read_header(compress(base, ft, tmp_path / "d.safetensors", progress=False))
    dense = [t.param for t in h.tensors if t.role == "dense"]
    assert not any("norm" in n for n in dense), dense


def test_distillation_lowers_heldout_logit_mse(family, delta_file):
    from bitdelta import distill as d

    base, (v0, _) = family
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 256, (4000,), generator=g)
    heldout = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(9))
    cfg = d.DistillConfig(steps=25, lr=5e-4, batch=4, seq_len=32)
    delta, record = d.distill(base, v0, load_delta(delta_file), calib, cfg, heldout, progress=False)
    assert record["heldout_mse_after"] < record["heldout_mse_before"] * 0.97, record
    assert delta.meta.distilled["steps"] == 25
    # Only α changed: signs and dense tensors are the same objects' values.
    before = load_delta(delta_file)
    for k, cw in delta.compressed.items():
        assert torch.equal(cw.signs, before.compressed[k].signs)
    assert any(not torch.equal(cw.alpha, before.compressed[k].alpha) for k, cw in delta.compressed.items())


# --- bad files ---------------------------------------------------------------------


def _run_cli(*args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "bitdelta.cli", *args], capture_output=True, text=True, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


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
    code, out = _run_cli("verify", str(bad))
    assert code != 0 and target.name in out


def test_truncated_file_is_rejected(delta_file, tmp_path):
    bad = tmp_path / "trunc.safetensors"
    data = delta_file.read_bytes()
    h = read_header(delta_file)
    bad.write_bytes(data[: h.tensors[-1].start + 5])
    with pytest.raises(DeltaFormatError, match="truncated"):
        load_delta(bad)
    code, out = _run_cli("verify", str(bad))
    assert code != 0 and "truncated" in out and h.tensors[-1].name in out
    (tmp_path / "tiny").write_bytes(data[:5])
    code, out = _run_cli("inspect", str(tmp_path / "tiny"))
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
    code, out = _run_cli("verify", str(delta_file), "--base", str(other_base))
    assert code != 0 and "fingerprint" in out
    code, out = _run_cli("apply", "--base", str(other_base), "--delta", str(delta_file), "--out", str(tmp_path / "o2"))
    assert code != 0 and "built for base" in out


def test_interrupted_compress_leaves_nothing(family, tmp_path, monkeypatch):
    from bitdelta import format as fmt

    base, (v0, _) = family
    calls = {"n": 0}
    real = fmt.tensor_bytes

    def flaky(t):
        calls["n"] += 1
        if calls["n"] > 40:  # past hashing, in the middle of writing data
            raise KeyboardInterrupt
        return real(t)

    monkeypatch.setattr(fmt, "tensor_bytes", flaky)
    out = tmp_path / "d.safetensors"
    with pytest.raises(KeyboardInterrupt):
        compress(base, v0, out, progress=False)
    assert calls["n"] > 40
    assert list(tmp_path.iterdir()) == [], "no partial or final file may remain"


def test_cli_compress_inspect_apply(family, tmp_path):
    base, (v0, _) = family
    out = tmp_path / "c.safetensors"
    code, text = _run_cli(
        "compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--alpha", "matrix"
    )
    assert code == 0, text
    code, text = _run_cli("inspect", str(out), "--json")
    info = json.loads(text[text.index("{") :])
    assert info["alpha_mode"] == "matrix"
    assert info["bytes"]["total"] == out.stat().st_size
    assert info["ratio_compressed_part"] > 10  # 1 bit vs 16 bits, less the scales
    code, text = _run_cli("verify", str(out), "--base", str(base))
    assert code == 0 and "OK" in text
    code, text = _run_cli("compress", "--base", str(base), "--finetuned", str(tmp_path / "nope"), "--out", str(out))
    assert code != 0 and "config.json" in text


# --- protos ------------------------------------------------------------------------


def test_generated_protos_import():
    from bitdelta.delta_store.v1 import delta_store_pb2, delta_store_pb2_grpc
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2, gpu_worker_pb2_grpc
    from bitdelta.router.v1 import router_pb2, router_pb2_grpc

    assert router_pb2.DESCRIPTOR.package == "bitdelta.router.v1"
    assert gpu_worker_pb2.DeltaState.Name(0) == "DELTA_STATE_UNSPECIFIED"
    assert delta_store_pb2.AlphaMode.Value("ALPHA_MODE_ROW") == 1
    assert hasattr(router_pb2_grpc, "RouterServiceStub")
    assert hasattr(gpu_worker_pb2_grpc, "GpuWorkerServiceServicer")
    assert hasattr(delta_store_pb2_grpc, "add_DeltaStoreServiceServicer_to_server")


def test_buf_lint_passes():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    p = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_written_files_are_shareable(family, tmp_path):
    base, (v0, _) = family
    out = compress(base, v0, tmp_path / "d.safetensors", progress=False)
    assert out.stat().st_mode & 0o044 == 0o044, oct(out.stat().st_mode)  # group/other may read
    ck = apply(base, out, tmp_path / "ck", progress=False)
    assert ck.stat().st_mode & 0o055 == 0o055, oct(ck.stat().st_mode)
