"""The generation vocabulary (bitdelta/generation.py): one validate() naming the field, one
model-id rule, and conversions to and from protobuf that keep every value (and read v1's zeros as
unset)."""

from __future__ import annotations

import math

import pytest

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.generation import (
    ArrivalState,
    Constraint,
    ConstraintKind,
    FinishReason,
    GenerationError,
    Logprobs,
    Request,
    Sampling,
    TokenEvent,
    TokenLogprob,
    Ttft,
    Usage,
    check_model_id,
)
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.rpc.wire.gpu_worker import events_of_pb, events_to_pb, request_to_pb


@pytest.mark.parametrize(
    "sampling,field",
    [
        (Sampling(temperature=math.nan), "sampling.temperature"),
        (Sampling(temperature=1e-4), "sampling.temperature"),
        (Sampling(temperature=101.0), "sampling.temperature"),
        (Sampling(temperature=-1.0), "sampling.temperature"),
        (Sampling(top_p=0.0), "sampling.top_p"),
        (Sampling(top_p=1.5), "sampling.top_p"),
        (Sampling(top_p=math.inf), "sampling.top_p"),
        (Sampling(max_new_tokens=-1), "sampling.max_new_tokens"),
        (Sampling(stop=("s",) * 17), "sampling.stop"),
        (Sampling(stop=("",)), "sampling.stop"),
        (Sampling(stop=("s" * 257,)), "sampling.stop"),
        (Sampling(seed=2**64), "sampling.seed"),
        (Sampling(top_k=-1), "sampling.top_k"),
        (Sampling(min_p=1.5), "sampling.min_p"),
        (Sampling(repetition_penalty=0.0), "sampling.repetition_penalty"),
        (Sampling(repetition_penalty=math.nan), "sampling.repetition_penalty"),
        (Sampling(presence_penalty=2.5), "sampling.presence_penalty"),
        (Sampling(frequency_penalty=-3.0), "sampling.frequency_penalty"),
        (Sampling(logit_bias=((5, 101.0),)), "sampling.logit_bias"),
        (Sampling(logit_bias=((-1, 1.0),)), "sampling.logit_bias"),
        (Sampling(logit_bias=tuple((i, 1.0) for i in range(1025))), "sampling.logit_bias"),
        (Sampling(stop_token_ids=(-1,)), "sampling.stop_token_ids"),
        (Sampling(stop_token_ids=tuple(range(65))), "sampling.stop_token_ids"),
        (Sampling(min_tokens=-1), "sampling.min_tokens"),
        (Sampling(max_new_tokens=4, min_tokens=5), "sampling.min_tokens"),
        (Sampling(logprobs=21), "sampling.logprobs"),
        (Sampling(logprobs=-1), "sampling.logprobs"),
        (Sampling(constraint=Constraint(ConstraintKind.REGEX)), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.JSON_OBJECT, "{}")), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.JSON_SCHEMA, "[1]")), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.JSON_SCHEMA, "{")), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.REGEX, "a" * 65537)), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.CHOICE)), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.CHOICE, choices=("a", ""))), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.CHOICE, choices=("a",) * 257)), "sampling.constraint"),
        (Sampling(constraint=Constraint(ConstraintKind.REGEX, "a", choices=("a",))), "sampling.constraint"),
        (Sampling(min_tokens=1, constraint=Constraint(ConstraintKind.JSON_OBJECT)), "sampling.min_tokens"),
        (Sampling(ignore_eos=True, constraint=Constraint(ConstraintKind.JSON_OBJECT)), "sampling.ignore_eos"),
    ],
)
def test_validate_names_the_field(sampling, field):
    with pytest.raises(GenerationError) as e:
        sampling.validate()
    assert e.value.field == field and str(e.value).startswith(field + ":")
    with pytest.raises(GenerationError) as e:
        Request("v0", "hi", sampling).validate()
    assert e.value.field == field


def test_the_edges_pass():
    for s in (Sampling(), Sampling(temperature=1e-3, top_p=1e-6, seed=0), Sampling(temperature=100.0, seed=2**64 - 1)):
        assert s.validate() is s


@pytest.mark.parametrize("name", ["v0", "smollm2.coder-1_b", "a" * 128])
def test_model_ids(name):
    assert check_model_id(name) == name


@pytest.mark.parametrize("name", ["", "../etc/passwd", "a..b", ".hidden", "a/b", "a" * 129, "é"])
def test_bad_model_ids_name_the_field_and_clip_the_value(name):
    with pytest.raises(GenerationError) as e:
        check_model_id(name, "name")
    assert e.value.field == "name" and "is not a model name" in str(e.value)


def test_the_store_uses_the_same_model_id_rule():
    from services.delta_store.backends import check_name
    from services.delta_store.errors import InvalidName

    assert check_name("smollm2.coder-1_b") == "smollm2.coder-1_b"
    for bad in ("a..b", "x" * 20_000, "a/b"):
        with pytest.raises(InvalidName) as e:
            check_name(bad)
        assert len(str(e.value)) < 300  # the echoed value is clipped


def test_every_field_round_trips():
    s = Sampling(
        max_new_tokens=9,
        temperature=0.5,
        top_p=0.5,
        stop=("x",),
        seed=3,
        top_k=7,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.75,
        logit_bias=((3, -1.0), (70, 2.5)),
        stop_token_ids=(1, 9),
        min_tokens=2,
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=0,
    ).validate()
    assert Sampling.from_pb(gen_pb.SamplingParams.FromString(s.to_pb().SerializeToString())) == s
    assert not s.plain and Sampling(top_k=3, temperature=1.0).plain, "only logit changes make a row non-plain"
    for c in (
        Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'),
        Constraint(ConstraintKind.JSON_OBJECT),
        Constraint(ConstraintKind.REGEX, "[a-z]+"),
        Constraint(ConstraintKind.CHOICE, choices=("a", "b ☃")),
        Constraint(ConstraintKind.GRAMMAR, 'start: "x"'),
    ):
        sc = Sampling(constraint=c).validate()
        assert Sampling.from_pb(gen_pb.SamplingParams.FromString(sc.to_pb().SerializeToString())) == sc
        assert not sc.plain, "a constrained row is masked"
    assert Sampling.from_pb(Sampling().to_pb()).constraint is None
    with pytest.raises(GenerationError, match="vocabulary size 50"):
        s.check_vocab(50)
    assert s.check_vocab(71) is s


def test_sampling_round_trips_and_reads_zeros_as_unset():
    s = Sampling(max_new_tokens=7, temperature=0.5, top_p=0.25, stop=("a", "bc"), seed=0)
    m = s.to_pb()
    assert m.HasField("seed") and m.seed == 0, "seed 0 is a seed, sent with presence"
    assert Sampling.from_pb(m) == s
    assert Sampling.from_pb(gen_pb.SamplingParams()) == Sampling(), "zeros: greedy, top_p 1, random seed"
    assert not Sampling().to_pb().HasField("seed") and not Sampling().to_pb().HasField("logprobs")
    # a v1 sender that wrote seed 0 without presence (proto3 drops it) asked for a random seed
    assert Sampling.from_pb(gen_pb.SamplingParams.FromString(b"")).seed is None


def test_worker_events_round_trip():
    first = TokenEvent(
        5,
        "he",
        1.5,
        ttft=Ttft(delta_load_ms=1.0, schedule_ms=2.0, prefill_ms=3.0, total_ms=6.0),
        arrival=ArrivalState.COLD,
    )
    lp = Logprobs(TokenLogprob(9, "llo", -0.5), (TokenLogprob(9, "llo", -0.5), TokenLogprob(3, "x", -1.25)))
    last = TokenEvent(9, "llo", 9.0, finish_reason=FinishReason.EOS, usage=Usage(4, 2), logprobs=lp)
    middle = TokenEvent(7, "", 3.0)
    wire = lambda evs: events_of_pb(wpb.GenerateResponse.FromString(events_to_pb(evs).SerializeToString()))
    for ev in (first, last, middle, TokenEvent(1, "", 0.5, ttft=Ttft(), arrival=ArrivalState.BASE)):
        assert wire([ev]) == [ev]
    assert wire([first, middle, last]) == [first, middle, last], "one message holds several tokens, in order"
    msg = events_to_pb([first, middle, last])
    assert msg.arrival_state == wpb.DELTA_STATE_ABSENT and len(msg.tokens) == 3
    assert msg.tokens[2].finish_reason == gen_pb.FINISH_REASON_EOS and not msg.tokens[0].HasField("usage")
    with pytest.raises(ValueError, match="first token"):  # the request's fields belong to the stream's first token
        events_to_pb([middle, first])
    with pytest.raises(ValueError, match="at least one"):
        events_to_pb([])


def test_requests_reach_the_worker_unchanged():
    req = Request("v1", "hello", Sampling(max_new_tokens=3, temperature=1.0, seed=11), request_id="r-1", templated=True)
    assert Request.from_pb(request_to_pb(req)) == req


def test_finish_reasons_round_trip():
    for f in FinishReason:
        assert FinishReason.from_pb(f.to_pb()) is f
    assert FinishReason.from_pb(gen_pb.FINISH_REASON_UNSPECIFIED) is None
