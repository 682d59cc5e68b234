"""vLLM's sampling fields in the worker, each against an independent reference on the dense model
(transformers' LlamaForCausalLM on the base and on a variant's dense checkpoint W_base + α·S):
greedy with a repetition penalty, a logit bias and min_tokens equals transformers' generate with
the same processors; presence and frequency penalties equal a torch reference loop of the rule
(top_k, top_p and min_p against transformers' warpers: test_worker_units.py). Every rule is per row: a
batch mixing all of them gives each request the tokens it gets alone, seeded or greedy."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import pytest_asyncio
import torch

from bitdelta.generation import FinishReason, Request, Sampling
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from tests.support.worker import running_worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_kernels")]

N = 16
EOS = 256
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("sampling_family"), n_variants=1)


@pytest.fixture(scope="module")
def tok(family):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(family.base / "tokenizer.json"))


@pytest.fixture(scope="module")
def dense(family):
    """model id -> transformers' model of the same weights (the variant's dense checkpoint)."""
    from transformers import LlamaForCausalLM

    load = lambda path: LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return {"": load(family.base), "v0": load(family.merged["v0"])}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(family):
    cfg = WorkerConfig(base=family.base, delta_dir=str(family.deltas), delta_budget=4 << 20, kv_cache=4 << 20)
    async with running_worker(cfg) as (w, _, _):
        yield w


async def run(worker, model: str, sampling: Sampling, prompt: str = PROMPT):
    evs = [ev async for ev in worker.generate(Request(model, prompt, sampling))]
    return [e.token_id for e in evs], "".join(e.text for e in evs), evs[-1]


@pytest.mark.parametrize("model", ["", "v0"])
async def test_greedy_with_repetition_penalty_bias_and_min_tokens_equals_transformers(worker, dense, tok, model):
    ids = tok.encode(PROMPT).ids
    plain, _, _ = await run(worker, model, Sampling(max_new_tokens=N))
    s = Sampling(max_new_tokens=N, repetition_penalty=1.8, logit_bias=((EOS, 12.0), (plain[1], -5.0)), min_tokens=5)
    got, _, last = await run(worker, model, s)
    with torch.no_grad():
        out = dense[model].generate(
            torch.tensor([ids]),
            max_new_tokens=N,
            do_sample=False,
            repetition_penalty=1.8,
            sequence_bias={(EOS,): 12.0, (plain[1],): -5.0},
            min_new_tokens=5,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    want = out[0, len(ids) :].tolist()
    if want[-1] == EOS:  # transformers pads after EOS; the worker stops at it
        want = want[: want.index(EOS) + 1]
    assert got == want and got != plain
    assert EOS not in got[:5], "min_tokens holds EOS back"
    if got[-1] == EOS:
        assert last.finish_reason is FinishReason.EOS and len(got) >= 6


@pytest.mark.parametrize("model", ["", "v0"])
async def test_allowed_token_ids_equal_transformers_with_every_other_token_suppressed(worker, dense, tok, model):
    """vLLM's allowed_token_ids: greedy picks only among them, as transformers' generate does with
    every other token suppressed (SuppressTokensLogitsProcessor); a seeded draw stays inside them."""
    ids = tok.encode(PROMPT).ids
    plain, _, _ = await run(worker, model, Sampling(max_new_tokens=N))
    allowed = sorted({*plain[1::2], 66, 101, 115, EOS})  # some of its own picks, some others
    got, _, _ = await run(worker, model, Sampling(max_new_tokens=N, allowed_token_ids=tuple(allowed)))
    vocab = dense[model].config.vocab_size
    with torch.no_grad():
        out = dense[model].generate(
            torch.tensor([ids]),
            max_new_tokens=N,
            do_sample=False,
            suppress_tokens=[t for t in range(vocab) if t not in allowed],
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    want = out[0, len(ids) :].tolist()
    if want[-1] == EOS:
        want = want[: want.index(EOS) + 1]
    assert got == want and got != plain and set(got) <= set(allowed)
    drawn, _, _ = await run(
        worker, model, Sampling(max_new_tokens=N, temperature=1.0, seed=2, allowed_token_ids=(66, 101, 115))
    )
    assert set(drawn) <= {66, 101, 115} and len(set(drawn)) > 1


def reference_penalised_greedy(model, ids: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """The OpenAI rule by hand, on transformers' logits: l -= frequency * count + presence * (count > 0)."""
    out: list[int] = []
    counts = torch.zeros(model.config.vocab_size)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        t = int(logits.argmax())
        out.append(t)
        counts[t] += 1
        if t == EOS:
            break
    return out


@pytest.mark.parametrize("model,presence,frequency", [("", -2.0, 0.3), ("v0", 0.7, 1.1)])
async def test_greedy_with_presence_and_frequency_penalties_equals_a_torch_reference(
    worker, dense, tok, model, presence, frequency
):
    """(The base repeats nothing in N tokens on its own: a negative presence penalty invites repeats.)"""
    ids = tok.encode(PROMPT).ids
    want = reference_penalised_greedy(dense[model], ids, N, presence, frequency)
    s = Sampling(max_new_tokens=N, presence_penalty=presence, frequency_penalty=frequency)
    got, _, _ = await run(worker, model, s)
    plain, _, _ = await run(worker, model, Sampling(max_new_tokens=N))
    assert got == want and got != plain


async def test_stop_token_ids_ignore_eos_and_include_stop_str(worker, tok):
    plain, text, _ = await run(worker, "v0", Sampling(max_new_tokens=N))
    k = next(i for i in range(2, N) if plain[i] not in plain[:i])  # a token seen first at position k
    got, got_text, last = await run(worker, "v0", Sampling(max_new_tokens=N, stop_token_ids=(plain[k],)))
    assert got == plain[: k + 1] and last.finish_reason is FinishReason.STOP
    assert got_text == tok.decode(plain[:k], skip_special_tokens=True), "the stop token's text is not returned"
    _, with_stop, _ = await run(
        worker, "v0", Sampling(max_new_tokens=N, stop_token_ids=(plain[k],), include_stop_str_in_output=True)
    )
    assert with_stop == tok.decode(plain[: k + 1], skip_special_tokens=True)
    # min_tokens: the stop token cannot end the output before it
    late, _, _ = await run(worker, "v0", Sampling(max_new_tokens=N, stop_token_ids=(plain[k],), min_tokens=k + 2))
    assert len(late) > k + 1 and late[k] != plain[k]

    stop = text[len(text) // 2 : len(text) // 2 + 2]
    i = text.index(stop)
    _, cut, last = await run(worker, "v0", Sampling(max_new_tokens=N, stop=(stop,)))
    _, kept, _ = await run(worker, "v0", Sampling(max_new_tokens=N, stop=(stop,), include_stop_str_in_output=True))
    assert cut == text[:i] and kept == text[: i + len(stop)] and last.finish_reason is FinishReason.STOP

    eos_first = Sampling(max_new_tokens=6, logit_bias=((EOS, 100.0),))
    assert (await run(worker, "v0", eos_first))[0] == [EOS]
    ignored, _, last = await run(worker, "v0", Sampling(max_new_tokens=6, logit_bias=((EOS, 100.0),), ignore_eos=True))
    assert ignored == [EOS] * 6 and last.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("model", ["", "v0"])
async def test_bad_words_equal_transformers_no_bad_words(worker, dense, tok, model):
    """vLLM's bad_words: a one-token word is never picked, a two-token word's second token is masked
    after its first; greedy equals transformers' generate with the same words' ids
    (NoBadWordsLogitsProcessor). A bias towards eight letters makes the random model write words."""
    ids = tok.encode(PROMPT).ids
    letters = {tok.encode(c, add_special_tokens=False).ids[0]: c for c in "abcdefgh"}
    bias = tuple(sorted((t, 8.0) for t in letters))
    plain, _, _ = await run(worker, model, Sampling(max_new_tokens=N, logit_bias=bias))
    one = next(t for t in plain[1:] if t in letters)
    without_one, _, _ = await run(worker, model, Sampling(max_new_tokens=N, logit_bias=bias, bad_words=(letters[one],)))
    two = next((a, b) for a, b in zip(without_one[1:], without_one[2:]) if a in letters and b in letters)
    words = (letters[one], letters[two[0]] + letters[two[1]])
    got, text, _ = await run(worker, model, Sampling(max_new_tokens=N, logit_bias=bias, bad_words=words))
    with torch.no_grad():
        out = dense[model].generate(
            torch.tensor([ids]),
            max_new_tokens=N,
            do_sample=False,
            sequence_bias={(t,): b for t, b in bias},
            bad_words_ids=[[one], list(two)],
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    want = out[0, len(ids) :].tolist()
    if want[-1] == EOS:
        want = want[: want.index(EOS) + 1]
    assert got == want and got not in (plain, without_one)
    assert one not in got and words[1] not in text


async def test_masks_that_leave_no_token_are_invalid_argument(worker, tok):
    """allowed_token_ids that bad_words or min_tokens rule out entirely end the request with
    INVALID_ARGUMENT naming the field, never a pick among -inf logits; the next request is served."""
    from services.gpu_worker.errors import NoTokenLeft

    for s in (
        Sampling(max_new_tokens=4, allowed_token_ids=tuple(tok.encode("e").ids), bad_words=("e",)),
        Sampling(max_new_tokens=4, allowed_token_ids=(EOS,), min_tokens=2),
    ):
        with pytest.raises(NoTokenLeft, match="sampling.allowed_token_ids: .* no token to pick at output token 1"):
            await run(worker, "", s)
    assert len((await run(worker, "", Sampling(max_new_tokens=4)))[0]) == 4


async def test_skip_special_tokens_false_keeps_their_text(worker):
    """vLLM's skip_special_tokens: false keeps a special token's text in the output; EOS still ends
    it, its own text only with include_stop_str_in_output (as a stop token's)."""
    im_start = Sampling(max_new_tokens=3, logit_bias=((257, 100.0),))  # <|im_start|>, a special token
    ids, text, _ = await run(worker, "", im_start)
    assert ids == [257] * 3 and text == ""
    _, text, _ = await run(worker, "", dataclasses.replace(im_start, skip_special_tokens=False))
    assert text == "<|im_start|>" * 3
    eos = Sampling(max_new_tokens=3, logit_bias=((EOS, 100.0),), skip_special_tokens=False)
    ids, text, last = await run(worker, "", eos)
    assert ids == [EOS] and text == "" and last.finish_reason is FinishReason.EOS
    _, text, last = await run(worker, "", dataclasses.replace(eos, include_stop_str_in_output=True))
    assert text == "<|endoftext|>" and last.finish_reason is FinishReason.EOS


async def test_every_rule_is_per_row_in_a_mixed_batch(worker):
    """Nine requests, two models, every rule: alone, then all at once in shared steps: each gets the
    same tokens (seeded draws included: each row has its own generator)."""
    jobs = [
        ("v0", Sampling(max_new_tokens=N)),
        ("", Sampling(max_new_tokens=N, repetition_penalty=1.5)),
        ("v0", Sampling(max_new_tokens=N, presence_penalty=1.0, frequency_penalty=0.5)),
        ("", Sampling(max_new_tokens=N, temperature=0.9, top_k=20, min_p=0.05, seed=3)),
        ("v0", Sampling(max_new_tokens=N, temperature=1.2, top_p=0.8, repetition_penalty=1.2, seed=4)),
        ("", Sampling(max_new_tokens=N, logit_bias=((65, 3.0),), min_tokens=4)),
        ("v0", Sampling(max_new_tokens=N, temperature=0.7, seed=3)),
        ("", Sampling(max_new_tokens=N, temperature=0.8, seed=5, allowed_token_ids=(66, 101, 115, 116))),
        ("v0", Sampling(max_new_tokens=N, bad_words=("e", "th"))),
    ]
    alone = [(await run(worker, m, s))[0] for m, s in jobs]
    steps = worker.engine.steps
    together = await asyncio.gather(*[run(worker, m, s) for m, s in jobs])
    assert [t[0] for t in together] == alone
    assert worker.engine.steps - steps < sum(map(len, alone)) * 0.5, "they shared steps"
    assert len({tuple(a) for a in alone}) >= 5, "the rules change the tokens"


async def test_token_ids_beyond_the_vocabulary_are_invalid_argument(worker):
    from bitdelta.generation import GenerationError

    for s, field in (
        (Sampling(logit_bias=((10**6, 1.0),)), "sampling.logit_bias"),
        (Sampling(stop_token_ids=(10**6,)), "sampling.stop_token_ids"),
        (Sampling(allowed_token_ids=(65, 10**6)), "sampling.allowed_token_ids"),
    ):
        with pytest.raises(GenerationError) as e:
            await run(worker, "", s)
        assert e.value.field == field and "vocabulary" in str(e.value)


async def test_logprobs_are_the_variants_raw_log_softmax(worker, dense, tok):
    """On a variant, sampled under penalties and a bias: each event's logprobs are transformers' log
    softmax of the dense model's raw logits at that position (before penalties, bias, temperature)."""
    ids = tok.encode(PROMPT).ids
    s = Sampling(max_new_tokens=N, temperature=0.8, seed=9, repetition_penalty=1.3, logit_bias=((65, 2.0),), logprobs=4)
    evs = [ev async for ev in worker.generate(Request("v0", PROMPT, s))]
    out = [e.token_id for e in evs]
    with torch.no_grad():
        logits = dense["v0"](torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
    ref = torch.log_softmax(logits, -1)
    for i, e in enumerate(evs):
        assert e.logprobs.sampled.token_id == out[i]
        assert abs(e.logprobs.sampled.logprob - float(ref[i, out[i]])) < 1e-4
        top_v, top_i = ref[i].topk(4)
        assert [t.token_id for t in e.logprobs.top] == top_i.tolist()
        assert [t.logprob for t in e.logprobs.top] == pytest.approx(top_v.tolist(), abs=1e-4)
        assert e.logprobs.sampled.token == tok.decode([out[i]], skip_special_tokens=False)
    none = [ev async for ev in worker.generate(Request("v0", PROMPT, Sampling(max_new_tokens=2)))]
    assert all(e.logprobs is None for e in none)
