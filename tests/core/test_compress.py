"""Compression (bitdelta.compress): the round trip compress -> apply is exact, sign-compressed
embeddings, an attached variant equals its applied checkpoint, unchanged parameters are not
stored, an interrupted compress leaves nothing, and the files written are shareable."""

from __future__ import annotations

import pytest
import torch

from bitdelta.checkpoint import CheckpointReader
from bitdelta.compress import apply, compress
from bitdelta.format import load_delta, read_header
from bitdelta.model import attach_delta, load_model
from bitdelta.testing.family import make_finetune, tiny_args


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


def test_written_files_are_shareable(family, tmp_path):
    base, (v0, _) = family
    out = compress(base, v0, tmp_path / "d.safetensors", progress=False)
    assert out.stat().st_mode & 0o044 == 0o044, oct(out.stat().st_mode)  # group/other may read
    ck = apply(base, out, tmp_path / "ck", progress=False)
    assert ck.stat().st_mode & 0o055 == 0o055, oct(ck.stat().st_mode)


def _set_eos(ckpt, config_eos, generation_eos=None) -> None:
    import json

    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "eos_token_id": config_eos}))
    if generation_eos is not None:
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))


def test_a_fine_tunes_own_eos_is_recorded_and_applied(family, tmp_path):
    """A chat fine-tune of a pretrained base often ends its turns on another token: its config's and
    generation config's eos_token_id ride in the delta where they are not the base's, and `apply`
    writes them into the dense checkpoint (transformers' generate then stops there too)."""
    import json
    import shutil

    base, (v0, _) = family
    same = compress(base, v0, tmp_path / "same.safetensors", progress=False)
    assert load_delta(same).meta.eos_token_ids == ()  # the base's own: nothing recorded
    assert "eos_token_ids" not in read_header(same).metadata
    ft = tmp_path / "ft"
    shutil.copytree(v0, ft)
    _set_eos(ft, 258, [258, 257])
    out = compress(base, ft, tmp_path / "own.safetensors", progress=False)
    assert load_delta(out).meta.eos_token_ids == (257, 258)
    applied = apply(base, out, tmp_path / "applied", progress=False)
    assert json.loads((applied / "config.json").read_text())["eos_token_id"] == [257, 258]
    assert json.loads((applied / "generation_config.json").read_text())["eos_token_id"] == [257, 258]
    _set_eos(ft, tiny_args().vocab_size)  # a token the model does not have
    with pytest.raises(ValueError, match="not below the vocabulary size"):
        compress(base, ft, tmp_path / "bad.safetensors", progress=False)
    _set_eos(ft, "x")
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        compress(base, ft, tmp_path / "bad.safetensors", progress=False)


TRUNCATION = {"direction": "Right", "max_length": 64, "strategy": "LongestFirst", "stride": 0}


def test_a_fine_tune_that_tokenizes_otherwise_carries_its_tokenizer(family, tmp_path):
    """A fine-tune whose tokenizer.json reads or writes text otherwise (a special token renamed, a
    normalizer) has it carried in its delta (the worker serves the variant with it); the same
    tokenizer written out anew (other formatting, a truncation setting) is not carried; a file the
    `tokenizers` library cannot read is refused."""
    import json
    import shutil

    base, (v0, _) = family
    ft = tmp_path / "ft"
    shutil.copytree(v0, ft)
    tok = json.loads((base / "tokenizer.json").read_text())
    (ft / "tokenizer.json").write_text(json.dumps({**tok, "truncation": TRUNCATION}, indent=4))
    assert load_delta(compress(base, ft, tmp_path / "ok.safetensors", progress=False)).files == {}
    renamed = [{**t, "content": "<|reserved|>"} if t["id"] == 257 else t for t in tok["added_tokens"]]
    for other in ({**tok, "added_tokens": renamed}, {**tok, "normalizer": {"type": "Lowercase"}}):
        (ft / "tokenizer.json").write_text(json.dumps(other))
        d = load_delta(compress(base, ft, tmp_path / "own.safetensors", progress=False))
        assert d.files == {"tokenizer.json": (ft / "tokenizer.json").read_bytes()} and d.meta.tokenizer_sha256
    (ft / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizer the `tokenizers` library reads"):
        compress(base, ft, tmp_path / "bad.safetensors", progress=False)
    assert not (tmp_path / "bad.safetensors").exists()


def test_a_fine_tunes_own_chat_template_and_sampling_defaults_ride_in_its_delta(family, tmp_path):
    """Where the fine-tune's chat template (with its special tokens) or generation config's sampling
    defaults are not the base's, the delta records them (the gateway serves the variant with them),
    inspect names them, and apply writes them into the dense checkpoint; the base's are not recorded."""
    import json
    import shutil

    from bitdelta.model_files import read_chat_template, read_sampling
    from tests.support.cli import run_cli

    base, (v0, _) = family
    meta = load_delta(compress(base, v0, tmp_path / "same.safetensors", progress=False)).meta
    assert meta.chat_template is None and meta.sampling_defaults == {}
    ft = tmp_path / "ft"
    shutil.copytree(v0, ft)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (ft / "chat_template.jinja").write_text(template)
    (ft / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (ft / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5, "do_sample": True}))
    code, out = run_cli(
        "compress", "--base", str(base), "--finetuned", str(ft), "--out", str(tmp_path / "d.safetensors")
    )
    assert code == 0, out
    assert f"its own ({len(template)} characters)" in out and 'its own: {"temperature": 0.3, "top_k": 5}' in out
    meta = load_delta(tmp_path / "d.safetensors").meta
    assert meta.chat_template.source == template and meta.chat_template.specials == {"eos_token": "<|im_end|>"}
    assert meta.sampling_defaults == {"temperature": 0.3, "top_k": 5}
    dense = apply(base, tmp_path / "d.safetensors", tmp_path / "applied", progress=False)
    assert read_chat_template(dense).source == template
    assert read_sampling(dense) == {"temperature": 0.3, "top_k": 5}
    (ft / "generation_config.json").write_text(json.dumps({"top_p": 2}))  # out of its rule
    with pytest.raises(ValueError, match="top_p: must be a number greater than 0 and at most 1"):
        compress(base, ft, tmp_path / "bad.safetensors", progress=False)
