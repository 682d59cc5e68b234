"""The one evaluator (bitdelta.evaluate) on hand-checkable cases: perplexity, accuracy, KL, gain
kept, the windowing rule and greedy decoding."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bitdelta import evaluate as ev


class FixedLogits(nn.Module):
    """A stand-in model whose next-token logits are the same at every position."""

    def __init__(self, logits: list[float]):
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [B, T] -> logits [B, T, V]
        return self.logits.expand(*ids.shape, -1).clone()


def test_uniform_model_has_perplexity_equal_to_vocab_size():
    wins = torch.randint(0, 4, (3, 6))
    s, _ = ev.score(FixedLogits([0.0, 0.0, 0.0, 0.0]), wins, batch=2)
    assert s.tokens == 3 * 5 and s.kl_from_ref is None
    assert s.ppl == pytest.approx(4.0, rel=1e-6) and s.nll == pytest.approx(math.log(4), rel=1e-6)


def test_perplexity_by_hand():
    # p = softmax(log [0.5, 0.25, 0.25]); targets: token 0 twice, token 1 twice.
    model = FixedLogits([math.log(0.5), math.log(0.25), math.log(0.25)])
    wins = torch.tensor([[2, 0, 1], [2, 1, 0]])  # targets 0,1 and 1,0
    s, _ = ev.score(model, wins, batch=1)
    expected = math.exp((2 * math.log(2) + 2 * math.log(4)) / 4)  # = sqrt(8)
    assert s.ppl == pytest.approx(expected, rel=1e-6)
    assert s.ppl == pytest.approx(math.sqrt(8), rel=1e-6)
    assert s.acc == pytest.approx(0.5)  # argmax is token 0: right on half of the targets


def test_kl_by_hand_and_zero_for_identical():
    p = torch.tensor([0.5, 0.5]).log()
    r = torch.tensor([0.25, 0.75]).log()
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert ev.kl_per_token(p, r).item() == pytest.approx(expected, rel=1e-6)
    assert ev.kl_per_token(p, p).item() == 0.0
    # Through score(): the reference's log-probs per batch.
    ref_model = FixedLogits([math.log(0.5), math.log(0.5)])
    wins = torch.zeros(2, 4, dtype=torch.long)
    _, ref = ev.score(ref_model, wins, batch=1)
    s, _ = ev.score(FixedLogits([math.log(0.25), math.log(0.75)]), wins, batch=1, ref_logp=ref)
    assert s.kl_from_ref == pytest.approx(expected, rel=1e-5)


def test_gain_kept():
    assert ev.gain_kept(10.0, 8.0, 9.0) == pytest.approx(0.5)
    assert ev.gain_kept(10.0, 8.0, 8.0) == pytest.approx(1.0)
    assert ev.gain_kept(10.0, 8.0, 10.5) == pytest.approx(-0.25)
    assert math.isnan(ev.gain_kept(10.0, 10.0, 9.0))


def test_windows_are_even_deterministic_and_never_overlap():
    tokens = torch.arange(1000)
    w = ev.windows(tokens, 4, 99)
    assert w.shape == (4, 100)
    assert w[0, 0] == 0 and w[-1, -1] == 999
    assert torch.equal(w, ev.windows(tokens, 4, 99))
    short = ev.windows(torch.arange(250), 8, 99)  # room for two windows of 100 without overlap
    assert short.shape == (2, 100) and short[0, -1] < short[1, 0]
    with pytest.raises(ValueError, match="need at least 21"):
        ev.windows(torch.arange(10), 2, 20)


def test_greedy_stops_and_matches_full_forward(tmp_path):
    from bitdelta.model import init_random
    from bitdelta.testing.family import tiny_args

    model = init_random(tiny_args(), seed=3)
    prompt = [5, 9, 11, 40]
    out = ev.greedy(model, prompt, 6, lambda ids: False)
    # Each greedy token is the argmax of a full (uncached) forward over the sequence so far.
    seq = list(prompt)
    with torch.no_grad():
        for t in out:
            assert int(model(torch.tensor([seq]))[0, -1].argmax()) == t
            seq.append(t)
    assert ev.greedy(model, prompt, 6, lambda ids: len(ids) == 2) == out[:2]
