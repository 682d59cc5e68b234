"""A fine-tune that reads text otherwise than its base (a special token renamed, as chat fine-tunes of
Llama 3 rename reserved tokens; a model distilled with another tokenizer of the same vocabulary size)
is served with its own tokenizer: `compress` carries the fine-tune's tokenizer.json in the delta, the
worker tokenizes the variant's prompts and writes its text with it and compiles its grammars for it;
the base and other variants keep the base's, in the same batches. The reference is transformers'
greedy on `bitdelta apply`'s dense model, fed the fine-tune's tokenizer's ids. A fine-tune with a
token its model has no row for (a resized vocabulary) is refused by name.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

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
    return root, base, deltas


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
