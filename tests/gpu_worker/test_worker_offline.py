"""`bitdelta.LLM`, the offline Python API: the worker's engine in-process, no server. Its greedy
tokens for the base and two variants, asked for in ONE call (one mixed batch), equal each dense
reference (`bitdelta apply`'s merged checkpoint through the compact model); sampling fields and `n`
reach the engine; a bad request or an unknown variant is a clear error and the LLM keeps serving."""

from __future__ import annotations

import grpc
import pytest

import bitdelta
from bitdelta.generation import FinishReason, GenerationError, Sampling
from bitdelta.rpc.errors import ServiceError
from bitdelta.testing.family import make_test_family
from tests.support.worker import offline_generate

N = 12
PROMPTS = ["Hello world", "def f(x):", "The quick brown fox"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("offline_family"), n_variants=2)


@pytest.fixture(scope="module")
def llm(family):
    with bitdelta.LLM(base=family.base, deltas=family.deltas, device="cpu", kernel_backend="cpu") as llm:
        yield llm


def test_one_mixed_call_equals_each_dense_reference(llm, family):
    models = ["", "v0", "v1"]
    outs = llm.generate(PROMPTS, model=models, sampling=Sampling(max_new_tokens=N))
    assert [(o.prompt, o.model, o.index) for o in outs] == [(p, m, 0) for p, m in zip(PROMPTS, models)]
    for o in outs:
        ckpt = family.base if o.model == "" else family.merged[o.model]
        want = offline_generate(ckpt, list(o.prompt.encode()), N, 256)
        assert list(o.token_ids) == want, o.model
        assert o.usage.completion_tokens == len(want) and o.usage.prompt_tokens == len(o.prompt.encode())
        assert o.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)


def test_sampling_fields_and_choices_reach_the_engine(llm):
    s = Sampling(max_new_tokens=8, temperature=1.0, seed=7, n=3, logprobs=2)
    outs = llm.generate("Hello", model="v0", sampling=s)
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == len(o.logprobs) for o in outs)
    assert all(len(lp.top) == 2 for o in outs for lp in o.logprobs)
    again = llm.generate("Hello", model="v0", sampling=s)  # seeded: reproducible
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert len({o.token_ids for o in outs}) > 1  # the choices' seeds differ


def test_bad_requests_are_clear_errors_and_it_keeps_serving(llm, family):
    with pytest.raises(GenerationError, match="top_p"):
        llm.generate("x", sampling=Sampling(top_p=0.0))
    with pytest.raises(ServiceError, match="no delta named 'nope'") as e:
        llm.generate("x", model="nope", sampling=Sampling(max_new_tokens=2))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ValueError, match="2 models for 1 prompts"):
        llm.generate(["x"], model=["v0", "v1"])
    out = llm.generate("Hello world", model="v1", sampling=Sampling(max_new_tokens=N))[0]
    assert list(out.token_ids) == offline_generate(family.merged["v1"], list(b"Hello world"), N, 256)
