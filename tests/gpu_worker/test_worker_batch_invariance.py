"""A request's greedy tokens do not depend on its batch on this tiny family: alone (fused
single-variant kernel) and in a mixed batch (base GEMM + batched delta) give the same tokens and,
token by token, the same logprobs within one unit of a logit's last place, in fp32 and in bf16
(by default every path keeps the delta, so only the last bits move; the batch-invariant mode at
the end of the file makes the numbers themselves bit-identical); so do variants of three sign
planes, of a low-rank residual and of column α's (format v3), whose terms all land in the fp32
output before the one rounding. Two tokens at a near-tie (within that unit in both runs) may
swap; the request's later tokens then follow another text and are not compared.

The family has real delta magnitudes: fine-tune noise of 0.0006 on weights of std 0.2 gives
α/|W| ≈ 3e-3, as SmolLM2's fine-tunes (α 2e-4–7e-4 against |W| ≈ 0.15). In bf16 that delta is a
few tenths of the output's spacing, so any path that rounds before adding it (W + α·S rounded
to bf16; or the base GEMM's output rounded to bf16, then the delta added) loses it and changes
tokens. Kernels by device: the C CPU path on CPU (plus the Triton interpreter once), Triton on
CUDA, where `pytest -m cuda` runs this file with real bf16 dots.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bitdelta.compress import compress
from bitdelta.generation import Request, Sampling
from bitdelta.planes import PlaneConfig
from bitdelta.testing.family import VARIED_STD, make_base, make_finetune, tiny_args
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.worker import Worker

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cpu_kernels")]

N = 16
JOBS = [
    ("v0", "The quick brown fox"),
    ("", "Hello world"),
    ("v1", "abc xyz"),
    ("v2", "def f(x):"),
    ("v0", "Hello world"),
    ("planes3", "Once upon"),
    ("rank8", "The quick brown fox"),
    ("colauto", "abc xyz"),
]
REAL_SCALE = 0.0006  # fine-tune noise; the base's weights have std 0.2 (bitdelta.testing.family.VARIED_STD)
# How far a token's logprob may move between the two runs: one unit in the last place of a logit,
# which in bf16 is 2^-5 at this family's logits (|logit| in [4, 8)), plus the log-sum-exp's own
# last bits; fp32's paths differ by sum order alone. A path that loses the delta moves the
# sampled logprobs by 0.05-0.09 in bf16 here (test_the_check_catches_a_batch_dependent_path).
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 2**-5 + 2**-8}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    base = make_base(root / "base", tiny_args(), seed=1, std=VARIED_STD)
    for i in range(3):
        ft = make_finetune(base, root / f"ft{i}", seed=100 + i, scale=REAL_SCALE)
        compress(base, ft, root / "deltas" / f"v{i}.bitdelta.safetensors", variant=f"v{i}", progress=False)
        if i == 0:
            modes = {"planes3": PlaneConfig(planes=3), "rank8": PlaneConfig(rank=8)}
            modes["colauto"] = PlaneConfig(planes=2, alpha="auto")  # row and column α's
            for name, cfg in modes.items():
                out = root / "deltas" / f"{name}.bitdelta.safetensors"
                compress(base, ft, out, variant=name, planes=cfg, progress=False)
    return base, root / "deltas"


async def _run(family, dtype: str, n: int = N) -> tuple[list, list, list, int]:
    base, deltas = family
    w = Worker(WorkerConfig(base=base, delta_dir=str(deltas), delta_budget=4 << 20, kv_cache=4 << 20, dtype=dtype))
    await w.start()
    try:

        async def gen(m, p):
            req = Request(m, p, Sampling(max_new_tokens=n, logprobs=2))
            return [(e.token_id, {t.token_id: t.logprob for t in e.logprobs.top}) async for e in w.generate(req)]

        alone = [await gen(m, p) for m, p in JOBS]
        on_base = [[t for t, _ in await gen("", p)] for _, p in JOBS]
        steps = w.engine.steps
        mixed = await asyncio.gather(*[gen(m, p) for m, p in JOBS])
        return alone, mixed, on_base, w.engine.steps - steps
    finally:
        await w.close()


def _check(alone, mixed, on_base, steps, dtype: str):
    n, tol = len(alone[0]), LOGPROB_TOL[dtype]
    assert steps < len(JOBS) * n  # the sequences really shared steps
    swapped = 0
    for job, a, b in zip(JOBS, alone, mixed):
        assert len(a) == len(b) == n
        for i, ((ta, top_a), (tb, top_b)) in enumerate(zip(a, b)):
            if ta != tb:  # a near-tie: each run's pick and the other's within tol in that run
                assert tb in top_a and top_a[ta] - top_a[tb] <= tol, (job, i, top_a, top_b)
                assert ta in top_b and top_b[tb] - top_b[ta] <= tol, (job, i, top_a, top_b)
                swapped += 1
                break
            assert abs(top_a[ta] - top_b[tb]) <= tol, (job, i, top_a, top_b)
    assert swapped <= 1  # a swap is a rare event, not the rule
    # the deltas matter: some variant's tokens differ from the base's on the same prompt
    assert any([t for t, _ in a] != c for (m, _), a, c in zip(JOBS, alone, on_base) if m)


# plain functions with asyncio.run: the GPU machine's python has no pytest-asyncio, and an
# async test without it would be skipped, not run
@pytest.mark.parametrize("c_layers", [True, False], ids=["c_layers", "layer_by_layer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_do_not_depend_on_the_batch(family, dtype, c_layers, monkeypatch):
    # on CPU the decode rows run every layer in one C call (bitdelta_kernels.cpu_decode); the runner's
    # layer-by-layer path (GPUs, big batches) must be batch-invariant too
    from services.gpu_worker import runner

    if not c_layers:
        monkeypatch.setattr(runner.ModelRunner, "_c_decode_serves", lambda self, rows: False)
    _check(*asyncio.run(_run(family, dtype)), dtype)


def test_tokens_do_not_depend_on_the_batch_triton_bf16(family):
    # the Triton kernels' bf16 math (in the interpreter on CPU: bf16 operands dotted in fp32; there
    # 8 tokens a request, 2.5 of the suite's minutes with N; at 5 no variant's tokens leave the base's yet)
    from bitdelta_kernels.configs import interpreting
    from bitdelta_kernels.settings import configured

    with configured(backend="triton"):
        _check(*asyncio.run(_run(family, "bfloat16", n=8 if interpreting() else N)), "bfloat16")


def test_the_check_catches_a_batch_dependent_path(family, monkeypatch):
    # the previous mixed path (base GEMM rounded to bf16, then the delta added) loses the delta
    # and changes tokens: the same check fails on it
    from services.gpu_worker import runner

    def round_first(self, x, w):
        return (x @ w.t()).float()

    monkeypatch.setattr(runner.ModelRunner, "_mm_fp32", round_first)
    monkeypatch.setattr(runner.ModelRunner, "_c_decode_serves", lambda self, rows: False)  # layer by layer
    with pytest.raises(AssertionError):
        _check(*asyncio.run(_run(family, "bfloat16")), "bfloat16")


# -- batch-invariant mode (--batch-invariant): the numbers themselves, not only the tokens --------
# The checks above compare greedy tokens, which a near-tie flips only rarely on a tiny model. The
# mode promises more: a row's every value is the same whatever its step holds. Its logprobs (fp32,
# from the logits) must then be bit-identical alone and in a crowded batch: more decode rows than
# the C layers take by default (lowered to 4 here), prompts cut into other prefill chunks by a
# small token budget, prefix-cache hits that start a prefill mid-prompt, every delta form.
CROWD = [
    ("v0", "The quick brown fox jumps over the lazy dog, twice."),
    ("", "Hello world, hello again, and hello once more"),
    ("v1", "abc xyz abc xyz abc"),
    ("v2", "def f(x):\n    return x * x + 1"),
    ("v0", "Hello world"),
    ("planes3", "Once upon a time there was a fox"),
    ("rank8", "The quick brown fox jumps over the lazy dog, twice."),
    ("colauto", "abc xyz"),
    ("", "The quick brown fox"),
    ("v1", "Once upon a time"),
    ("rank8", "x = [i * i for i in range(10)]"),
    ("planes3", "abc"),
]


async def _crowd(family, dtype: str, invariant: bool):
    base, deltas = family
    cfg = WorkerConfig(
        base=base,
        delta_dir=str(deltas),
        delta_budget=8 << 20,
        kv_cache=4 << 20,
        dtype=dtype,
        device="cpu",  # the mode is the C CPU kernels' (also under `pytest -m cuda` on a GPU machine)
        max_batch_tokens=40,
        batch_invariant=invariant,
    )
    w = Worker(cfg)
    await w.start()
    try:

        async def gen(m, p):
            evs = [e async for e in w.generate(Request(m, p, Sampling(max_new_tokens=N, logprobs=2)))]
            return [(e.token_id, e.logprobs.sampled.logprob, tuple(t.logprob for t in e.logprobs.top)) for e in evs]

        alone = [await gen(m, p) for m, p in CROWD]
        steps = w.engine.steps
        crowd = await asyncio.gather(*[gen(m, p) for m, p in CROWD])
        return alone, crowd, w.engine.steps - steps
    finally:
        await w.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_mode_gives_every_row_the_same_numbers(family, dtype, monkeypatch):
    from bitdelta_kernels import cpu_ops
    from bitdelta_kernels.settings import current

    for t in (torch.float32, torch.bfloat16):  # 12 decode rows: past the C layers' default count
        monkeypatch.setitem(cpu_ops.DENSE_GEMV_MAX_M, t, 4)
    alone, crowd, steps = asyncio.run(_crowd(family, dtype, invariant=True))
    assert not current().batch_invariant  # the worker put the process's kernel settings back at close
    assert steps < len(CROWD) * N  # the sequences really shared steps
    for job, a, b in zip(CROWD, alone, crowd):
        assert len(a) == N
        assert a == b, job  # tokens and fp32 logprobs, bit for bit


def test_without_the_mode_the_numbers_do_depend_on_the_batch(family):
    # the same comparison fails without --batch-invariant (BLAS GEMMs and SDPA chunks pick their
    # sum order from the batch): the test above can fail
    alone, crowd, _ = asyncio.run(_crowd(family, "float32", invariant=False))
    assert any(a != b for a, b in zip(alone, crowd))


def test_batch_invariant_mode_is_refused_where_it_cannot_hold(family, monkeypatch):
    base, deltas = family
    for changes, why in [
        (
            {"kernel_backend": "torch", "device": "cpu"},
            "kernel backend is 'torch'",
        ),  # CPU: else the device is refused first
        ({"device": "meta"}, "CPU kernels only"),
    ]:
        with pytest.raises(ValueError, match=why):
            Worker(WorkerConfig(base=base, delta_dir=str(deltas), batch_invariant=True, **changes))


def test_batch_invariant_mode_a_conversation_that_goes_on_gives_the_numbers_of_a_cold_start(family):
    # the next turn's prompt repeats the answer: with the mode, blocks of generated tokens (their
    # K/V from the decode path) are not offered to it from the prefix cache, whose hit would give
    # other numbers than the cold prefill of the same prompt (fp32: on this tiny model the two paths'
    # numbers differ in fp32, and happen to agree in bf16)
    from bitdelta.generation import Constraint, ConstraintKind

    base, deltas = family
    first = "Once upon a time, in a land"
    words = Constraint(ConstraintKind.REGEX, "[a-z ]{40}")  # text that tokenizes back to the same ids

    async def turn(answer_first: bool, answer: str = ""):
        cfg = WorkerConfig(base=base, delta_dir=str(deltas), dtype="float32", device="cpu", batch_invariant=True)
        w = Worker(cfg)
        await w.start()
        try:
            if answer_first:  # 40 generated tokens: blocks 2 and 3 (of 16 tokens) hold only them
                s = Sampling(max_new_tokens=40, constraint=words)
                answer = "".join([e.text async for e in w.generate(Request("v0", first, s))])
            hits = w.scheduler.prefix_hits
            s = Sampling(max_new_tokens=N, logprobs=1)
            evs = [e async for e in w.generate(Request("v0", first + answer, s))]
            return answer, [(e.token_id, e.logprobs.sampled.logprob) for e in evs], w.scheduler.prefix_hits - hits
        finally:
            await w.close()

    answer, warm, hits = asyncio.run(turn(True))
    assert len(answer) == 40
    assert hits == 16  # the first prompt's one full block, not the answer's
    assert asyncio.run(turn(False, answer))[1] == warm
