"""A fine-tune that reads text otherwise than its base (a special token renamed, as chat fine-tunes of
Llama 3 rename reserved tokens; a model distilled with another tokenizer of the same vocabulary size)
is served with its own tokenizer: `compress` carries the fine-tune's tokenizer.json in the delta, the
worker tokenizes the variant's prompts and writes its text with it and compiles its grammars for it;
the base and other variants keep the base's, in the same batches. A fine-tune that added tokens
(its embedding and LM head resized, as a ChatML fine-tune of Mistral does) is served with its grown
vocabulary: its rows' embeddings and logits are its own tables' (the step's logits as wide as its
widest row, −inf past a row's own vocabulary). The reference is transformers' greedy on `bitdelta
apply`'s dense model, fed the fine-tune's tokenizer's ids. A tokenizer with a token its model has no
row for is refused by name.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.compress import apply, compress
from bitdelta.format import DeltaFormatError, load_delta, read_header, verify, write_delta
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.inspect_report import text as inspect_text
from bitdelta.model_files import own_tokenizer
from bitdelta.testing.family import SPECIALS, make_finetune, write_byte_tokenizer
from services.gpu_worker.config import WorkerConfig
from tests.support.archs import EOS, VOCAB, hf_model, make_hf_base
from tests.support.worker import running_worker

pytestmark = pytest.mark.usefixtures("cpu_kernels")
N = 10
OWN = "<think>"  # the fine-tune's name for token 258, the base's <|im_end|>
PROMPT = f"Question {OWN} answer"
SUFFIX = ".bitdelta.safetensors"


def write_own_tokenizer(out: Path, specials: list[str]) -> None:
    """The base's byte tokenizer with other special tokens (same ids, other text)."""
    from tokenizers import Tokenizer

    write_byte_tokenizer(out)
    tok = json.loads((out / "tokenizer.json").read_text())
    for entry, name in zip(tok["added_tokens"], specials, strict=True):
        entry["content"] = name
    (out / "tokenizer.json").write_text(json.dumps(tok))
    assert Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(specials[-1]) == VOCAB - 1


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("own_tokenizers")
    base = make_hf_base(root / "base", "llama-3.1", seed=7)
    deltas = root / "deltas"
    own = make_finetune(base, root / "own", seed=11, scale=0.02)
    write_own_tokenizer(own, [*SPECIALS[:-1], OWN])
    compress(base, own, deltas / f"own{SUFFIX}", variant="own", progress=False)
    plain = make_finetune(base, root / "plain", seed=12, scale=0.02)
    compress(base, plain, deltas / f"plain{SUFFIX}", variant="plain", progress=False)
    grown = make_grown(make_finetune(base, root / "grown", seed=13, scale=0.02))
    compress(base, grown, deltas / f"grown{SUFFIX}", variant="grown", progress=False)
    return root, base, deltas


ADDED = ["<tool>", "</tool>"]  # the grown fine-tune's tokens 259, 260


def make_grown(ft: Path) -> Path:
    """`ft` with two tokens added, as a fine-tune adding special tokens makes it: its embedding and LM
    head resized (the new rows trained: random here), its tokenizer with them."""
    from tokenizers import Tokenizer

    model = hf_model(ft)
    model.resize_token_embeddings(VOCAB + len(ADDED))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            w[VOCAB:] = 0.2 * torch.randn(len(ADDED), w.shape[1], generator=g)
    model.save_pretrained(ft)
    tok = Tokenizer.from_file(str(ft / "tokenizer.json"))
    tok.add_special_tokens(ADDED)
    tok.save(str(ft / "tokenizer.json"))
    return ft


def ids_of(ckpt: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(text).ids


def hf_greedy(ckpt: Path, ids: list[int]) -> list[int]:
    model = hf_model(ckpt)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, pad_token_id=EOS + 1)
    return out[0, len(ids) :].tolist()


def test_the_delta_carries_the_fine_tune_s_tokenizer_and_apply_writes_it(family, tmp_path):
    root, base, deltas = family
    file = deltas / f"own{SUFFIX}"
    header = verify(file)
    carried = (root / "own" / "tokenizer.json").read_bytes()
    assert [t.name for t in header.tensors if t.part == "file"] == ["tokenizer.json.file"]
    assert header.meta.tokenizer_sha256 == header.sha256["tokenizer.json.file"]
    assert load_delta(file).files == {"tokenizer.json": carried}
    assert "tokenizer         its own (tokenizer.json" in inspect_text(file)
    assert "tokenizer         the base's" in inspect_text(deltas / f"plain{SUFFIX}")
    assert read_header(deltas / f"plain{SUFFIX}").meta.tokenizer_sha256 == ""
    dense = apply(base, file, tmp_path / "dense", progress=False)
    assert (dense / "tokenizer.json").read_bytes() == carried
    # the header's name for it must be the file's: a tampered one is refused before any data is used
    bad = tmp_path / f"bad{SUFFIX}"
    d = load_delta(file)
    write_delta(bad, d.tensors(), replace(d.with_parts(), tokenizer_sha256=""))  # the sha256 left out
    with pytest.raises(DeltaFormatError, match="tokenizer_sha256"):
        verify(bad)


def test_only_a_tokenizer_that_reads_otherwise_is_carried_and_a_resized_one_is_refused(family, tmp_path):
    root, base, _ = family
    assert own_tokenizer(base, root / "plain", VOCAB) is None  # the same file
    same = tmp_path / "same"
    same.mkdir()
    tok = json.loads((base / "tokenizer.json").read_text())
    (same / "tokenizer.json").write_text(json.dumps(tok, indent=1))  # written otherwise, reads the same
    assert own_tokenizer(base, same, VOCAB) is None
    assert own_tokenizer(base, root / "own", VOCAB) == (root / "own" / "tokenizer.json").read_bytes()
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    write_byte_tokenizer(bigger)
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(bigger / "tokenizer.json"))
    t.add_special_tokens(["<extra>"])  # token 259: no row of the model's
    t.save(str(bigger / "tokenizer.json"))
    with pytest.raises(ValueError, match="has token 259, but the model's vocabulary has 259 rows"):
        own_tokenizer(base, bigger, VOCAB)


async def generate(stub, model: str, prompt: str, **sampling) -> tuple[list[int], str, int]:
    req = pb.GenerateRequest(
        model_id=model,
        prompt=prompt,
        sampling=gen_pb.SamplingParams(max_new_tokens=N, **sampling),
    )
    ids, text, prompt_tokens = [], "", 0
    async for m in stub.Generate(req, timeout=60):
        for t in m.tokens:
            ids.append(t.token_id)
            text += t.text
            if t.HasField("usage"):
                prompt_tokens = t.usage.prompt_tokens
    return ids, text, prompt_tokens


@pytest.mark.asyncio
async def test_the_worker_reads_and_writes_each_variant_with_its_own_tokenizer(family, tmp_path):
    root, base, deltas = family
    dense = {
        name: apply(base, deltas / f"{name}{SUFFIX}", tmp_path / name, progress=False) for name in ("own", "plain")
    }
    own_ids, base_ids = ids_of(dense["own"], PROMPT), ids_of(base, PROMPT)
    assert VOCAB - 1 in own_ids and len(base_ids) == len(own_ids) + len(OWN) - 1  # <think>: one token there
    want = {
        "own": hf_greedy(dense["own"], own_ids),
        "plain": hf_greedy(dense["plain"], base_ids),
        "": hf_greedy(base, base_ids),
    }
    assert len({tuple(v) for v in want.values()}) == 3
    cfg = WorkerConfig(base=base, delta_dir=str(deltas), kv_cache=4 << 20)
    async with running_worker(cfg) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        alone = {m: await generate(stub, m, PROMPT) for m in want}
        together = dict(zip(want, await asyncio.gather(*[generate(stub, m, PROMPT) for m in want])))
        for got in (alone, together):
            assert {m: g[0] for m, g in got.items()} == want
            assert got["own"][2] == len(own_ids) and got[""][2] == got["plain"][2] == len(base_ids)
        # the text is each one's tokenizer's: token 258 is <think> to the variant, <|im_end|> to the base
        from tokenizers import Tokenizer

        for m, (ids, text, _) in alone.items():
            tok = Tokenizer.from_file(str((dense[m] if m else base) / "tokenizer.json"))
            assert text == tok.decode(ids, skip_special_tokens=True)
        # a constraint compiles for the variant's tokenizer (its own compiler), and holds
        regex = gen_pb.Constraint(kind=gen_pb.CONSTRAINT_KIND_REGEX, text="[a-z]{4}")
        ids, text, _ = await generate(stub, "own", PROMPT, constraint=regex)
        assert len(text) == 4 and text.isalpha() and text.islower()
        assert len(worker._variant_grammars) == 1
        ids, text, _ = await generate(stub, "plain", PROMPT, constraint=regex)
        assert len(text) == 4 and len(worker._variant_grammars) == 1  # the base's compiler


@pytest.mark.asyncio
async def test_a_grown_vocabulary_is_served_with_its_own_rows_beside_the_base_s(family, tmp_path):
    root, base, deltas = family
    file = deltas / f"grown{SUFFIX}"
    meta = read_header(file).meta
    assert meta.vocab_size == VOCAB + 2 and meta.tokenizer_sha256
    assert f"its vocabulary grown to {VOCAB + 2} tokens" in inspect_text(file)
    dense = apply(base, file, tmp_path / "grown", progress=False)
    assert json.loads((dense / "config.json").read_text())["vocab_size"] == VOCAB + 2
    prompt = f"Call {ADDED[0]}x{ADDED[1]} now"
    ids = ids_of(dense, prompt)
    assert VOCAB in ids and VOCAB + 1 in ids  # the added tokens, read with its tokenizer
    want = {"grown": hf_greedy(dense, ids), "": hf_greedy(base, ids_of(base, prompt))}
    plain = apply(base, deltas / f"plain{SUFFIX}", tmp_path / "plain", progress=False)
    want["plain"] = hf_greedy(plain, ids_of(base, prompt))
    cfg = WorkerConfig(base=base, delta_dir=str(deltas), kv_cache=4 << 20)
    async with running_worker(cfg) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        alone = {m: (await generate(stub, m, prompt))[0] for m in want}
        together = await asyncio.gather(*[generate(stub, m, prompt) for m in want])
        assert alone == want and dict(zip(want, (t[0] for t in together))) == want
        # its added tokens are its to pick (a bias on one), and to write with its tokenizer
        ids, text, _ = await generate(stub, "grown", prompt, logit_bias={VOCAB + 1: 100.0}, skip_special_tokens=False)
        assert ids == [VOCAB + 1] * N and text == ADDED[1] * N
        for model in ("", "plain"):  # the base's vocabulary has no such token
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(stub, model, prompt, logit_bias={VOCAB + 1: 1.0})
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(VOCAB + 1) in e.value.details()
    # the step's logits: the grown row as wide as its vocabulary, the base's −inf past its own
    from services.gpu_worker.runner import SeqWork

    runner = worker.runner
    slot = worker.manager.entries["grown"].slot if "grown" in worker.manager.entries else None
    assert slot is not None
    logits = runner.forward([SeqWork(ids, 0, slot, [0, 1, 2, 3], True), SeqWork(ids[:3], 0, -1, [4], True)])
    with torch.no_grad():
        ref = hf_model(dense)(torch.tensor([ids])).logits[0, -1]
    assert logits.shape == (2, VOCAB + 2)
    torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)
    assert torch.isinf(logits[1, VOCAB:]).all() and torch.isfinite(logits[1, :VOCAB]).all()


def test_a_grown_vocabulary_is_refused_where_it_cannot_be_served(family, tmp_path):
    """On tensor-parallel ranks (their vocabulary split is the base's), compressed to signs, and
    without the tokenizer that names its tokens."""
    import asyncio as aio

    from bitdelta.arch import ModelArgs
    from bitdelta.checkpoint import read_config
    from bitdelta.format import ArchMismatchError
    from bitdelta.shard import TPLayout
    from services.gpu_worker.parallel import ShardedLoad
    from services.gpu_worker.slots import SlotLayout
    from services.gpu_worker.sources import LocalDeltaSource

    root, base, deltas = family
    args = ModelArgs.from_hf(read_config(base))
    info = aio.run(LocalDeltaSource(deltas).open("grown", read_header(deltas / f"grown{SUFFIX}").meta.base_fingerprint))
    tp = TPLayout(args, 2, 0)
    with pytest.raises(ArchMismatchError, match="grew the vocabulary to 261 tokens, which tensor-parallel ranks"):
        ShardedLoad(tp, SlotLayout(tp.local_args(), torch.float32), None, 1.0).plan(info)
    from bitdelta import plan

    header = read_header(deltas / f"grown{SUFFIX}")
    with pytest.raises(ValueError, match="plan it on one GPU"):  # the planner says what the worker does
        plan.make_plan(read_config(base), variants=1, gpu_mem=80e9, gpus=2, delta_file=header)
    one = plan.make_plan(read_config(base), variants=1, gpu_mem=80e9, gpus=1, delta_file=header)
    assert one.params > 0
    with pytest.raises(ValueError, match="stored dense .not --embeddings sign."):
        compress(base, root / "grown", tmp_path / f"x{SUFFIX}", embeddings="sign", progress=False)
    (tmp_path / "grown").mkdir()
    for f in (root / "grown").iterdir():
        if f.name != "tokenizer.json":
            (tmp_path / "grown" / f.name).write_bytes(f.read_bytes())
    write_byte_tokenizer(tmp_path / "grown")  # the base's tokenizer: no names for the added rows
    with pytest.raises(ValueError, match="tokenizer.json, which it needs to ship"):
        compress(base, tmp_path / "grown", tmp_path / f"y{SUFFIX}", progress=False)


def test_scale_distillation_keeps_what_the_delta_carries(family, tmp_path):
    """`compress --distill` rewrites the delta with tuned α's: the tokenizer and the grown vocabulary
    stay (a rewrite without the tokenizer that names a grown vocabulary is refused)."""
    from tests.support.cli import run_cli

    root, base, _ = family
    calib = tmp_path / "calib.txt"
    calib.write_text(f"Call {ADDED[0]}x{ADDED[1]} now, and some text to tune on. " * 20)
    out = tmp_path / f"g{SUFFIX}"
    args = ["--base", str(base), "--finetuned", str(root / "grown"), "--out", str(out), "--distill"]
    code, text = run_cli("compress", *args, "--calib", str(calib), "--steps", "3", "--seq-len", "32", "--batch", "2")
    assert code == 0, text
    meta = verify(out).meta
    assert meta.distilled and meta.vocab_size == VOCAB + 2
    assert load_delta(out).files["tokenizer.json"] == (root / "grown" / "tokenizer.json").read_bytes()
    d = load_delta(out)
    with pytest.raises(ValueError, match="a grown vocabulary is written with the tokenizer that names it"):
        from bitdelta.format import save_delta

        save_delta(tmp_path / f"bad{SUFFIX}", replace(d, files={}))
