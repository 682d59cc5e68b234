"""Picking tokens and turning them into text.

- `Sampler`: one sequence's way to pick its next token from its row of the step's logits, with
  the state its rules need (vLLM's order, `bitdelta.common.v1.SamplingParams`):

      l = logits                                   # fp32 [vocab], the model's raw row
      l[bias_ids] += bias
      l[not allowed_token_ids] = -inf              # when the request names allowed tokens
      l[last token of a bad word] = -inf           # when the output ends with the word's other tokens
      l[eos_ids + stop_token_ids] = -inf           # while the output is shorter than min_tokens
      l[seen] = where(l[seen] > 0, l / rep, l * rep)   # seen: prompt and output tokens
      l -= frequency * count + presence * (count > 0)  # count: each token in the output
      l[not allowed by the constraint's grammar] = -inf  # Sampling.constraint (constraints.py)
      greedy: argmax(l); else l / T cut by top_k, then top_p, then min_p (each on what the one
      before kept: transformers' warpers), p = softmax, drawn by the request's own generator:
      same seed, same tokens, whatever else is in the batch.

  A `plain` greedy sequence (nothing of the above) takes the batch's argmax and costs nothing.
- `TextStream`: incremental detokenisation (decode a short window around the
  new token so multi-byte characters and leading spaces come out right) and
  stop strings: text that could still become a stop string is held back, and
  the stop string itself is returned only with include_stop_str_in_output.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from bitdelta.generation import Sampling
from services.gpu_worker.errors import NoTokenLeft, SamplingError

if TYPE_CHECKING:
    from services.gpu_worker.constraints import GrammarState


class Sampler:
    """One sequence's picking rule and its state (module docstring). Runs on the CPU: the engine
    hands it its row of the logits."""

    def __init__(
        self,
        sampling: Sampling,
        prompt: list[int] = (),
        vocab_size: int = 0,
        eos_ids=frozenset(),
        grammar: GrammarState | None = None,
        bad_words: tuple[tuple[int, ...], ...] = (),
    ):
        self.sampling = sp = sampling
        self.vocab = vocab_size  # its model's vocabulary: the row's columns it reads (0: all of them)
        self.grammar = grammar  # Sampling.constraint compiled (constraints.py): masks each row, advances each pick
        self.temperature = float(sp.temperature)
        self.top_p = float(sp.top_p)
        self.greedy = sp.greedy
        self.plain = sp.greedy and sp.plain  # the batch's argmax is this sequence's pick
        self.n_out = 0
        self.generator = None
        if not self.greedy:
            seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.generator = torch.Generator().manual_seed(seed)
        self.seen = self.counts = None
        if sp.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # prompt and output tokens
            self.seen[torch.tensor(list(prompt), dtype=torch.int64)] = True
        if sp.presence_penalty or sp.frequency_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # output tokens
        self.bias_ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.int64)
        self.bias = torch.tensor([b for _, b in sp.logit_bias], dtype=torch.float32)
        self.banned = torch.tensor(sorted(set(eos_ids) | set(sp.stop_token_ids)), dtype=torch.int64)
        self.allowed = torch.tensor(sorted(set(sp.allowed_token_ids)), dtype=torch.int64)
        # Sampling.bad_words as token ids (`bad_word_ids`), those the model can produce
        self.bad_words = tuple(w for w in bad_words if not vocab_size or max(w) < vocab_size)
        self.out: list[int] = []  # the output so far, for the bad words' prefixes

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: fp32 [vocab] on the CPU -> the row after the bias, min_tokens and penalties
        (vLLM's and transformers' order: processors before penalties)."""
        sp = self.sampling
        # a step's rows are as wide as its widest vocabulary (a variant's grown one): this one's columns
        out = (logits[: self.vocab] if self.vocab else logits).float().clone()
        if len(self.bias_ids):
            out[self.bias_ids] += self.bias
        if len(self.allowed):
            keep = out[self.allowed]
            out.fill_(-math.inf)
            out[self.allowed] = keep
        for word in self.bad_words:  # vLLM's: the output's own tokens (not the prompt's) end with the rest
            k = len(word) - 1
            if k == 0 or (len(self.out) >= k and tuple(self.out[-k:]) == word[:-1]):
                out[word[-1]] = -math.inf
        if self.n_out < sp.min_tokens and len(self.banned):
            out[self.banned] = -math.inf
        if self.seen is not None:
            rep = sp.repetition_penalty
            hit = out[self.seen]
            out[self.seen] = torch.where(hit > 0, hit / rep, hit * rep)
        if self.counts is not None:
            out -= sp.frequency_penalty * self.counts + sp.presence_penalty * (self.counts > 0).float()
        if self.grammar is not None:
            self.grammar.mask(out)
        if (len(self.allowed) or self.bad_words) and not bool(torch.isfinite(out).any()):
            raise NoTokenLeft(
                f"sampling.allowed_token_ids: with bad_words and min_tokens it leaves no token to pick at "
                f"output token {self.n_out + 1}"
            )
        return out

    def distribution(self, row: torch.Tensor) -> torch.Tensor:
        """A processed row -> the probabilities the draw uses: [vocab], 0 where cut."""
        sp = self.sampling
        low = torch.tensor(-math.inf)
        lt = row / self.temperature
        if sp.top_k and sp.top_k < lt.numel():
            kth = torch.topk(lt, sp.top_k).values[-1]
            lt = torch.where(lt < kth, low, lt)
        if 0.0 < self.top_p < 1.0:
            sl, idx = lt.sort(descending=True)
            p = torch.softmax(sl, -1)
            cut = (p.cumsum(0) - p) >= self.top_p  # the smallest prefix whose mass reaches top_p stays
            cut[0] = False
            lt = lt.clone()
            lt[idx[cut]] = -math.inf
        if sp.min_p:
            p = torch.softmax(lt, -1)
            lt = torch.where(p < sp.min_p * p.max(), low, lt)
        return torch.softmax(lt, -1)

    def sample(self, logits: torch.Tensor) -> int:
        """logits: fp32 [vocab] on the CPU -> token id (and the state notes it). Raises SamplingError
        (this sequence only) when the probabilities are not finite: a NaN or infinite temperature or
        top_p, a temperature so small that logits / temperature overflows, or non-finite logits."""
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise self._error("the sampling parameters are not finite")
        row = self.process(logits)
        if self.greedy:
            tok = int(row.argmax())
        else:
            tok = self._draw(row)
        self.note(tok)
        return tok

    def note(self, tok: int) -> None:
        """`tok` joined the output (the plain path's pick too)."""
        self.n_out += 1
        if self.bad_words:
            self.out.append(tok)
        if self.grammar is not None:
            self.grammar.accept(tok)
        if self.seen is not None:
            self.seen[tok] = True
        if self.counts is not None:
            self.counts[tok] += 1

    def _draw(self, row: torch.Tensor) -> int:
        probs = self.distribution(row)
        if not bool(torch.isfinite(probs).all()):
            raise self._error("the token probabilities are not finite")
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _error(self, what: str) -> SamplingError:
        return SamplingError(
            f"cannot sample the next token: {what} (temperature={self.temperature!r}, "
            f"top_p={self.top_p!r}); use temperature 0 (greedy) or a finite temperature "
            "of at least 1e-3, and top_p in (0, 1]"
        )


def bad_word_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Sampling.bad_words as token sequences, as vLLM reads them: each word as the tokenizer writes it
    (leading spaces dropped, no special tokens), and again after a space where that makes another
    first token of the same length (a word mid-text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids)
        out += [
            w for w in (alone, spaced if spaced and len(spaced) == len(alone) and spaced[0] != alone[0] else ()) if w
        ]
    return tuple(out)


class TextStream:
    """Token ids in, text pieces out (see module docstring)."""

    def __init__(
        self, tokenizer, prompt: list[int], stop: list[str], include_stop: bool = False, skip_special: bool = True
    ):
        self.tok = tokenizer
        self.include_stop = include_stop
        self.skip_special = skip_special  # Sampling.skip_special_tokens
        self.ids = list(prompt)
        self.prefix_offset = max(len(prompt) - 5, 0)
        self.read_offset = len(prompt)
        self.stop = [s for s in stop if s]
        self.text = ""  # generated text so far (decoded)
        self.sent = 0  # characters of `text` already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token: int, may_stop: bool = True) -> tuple[str, str | None]:
        """Append one token. Returns (text to send now, the stop string it produced or None).
        `may_stop` False (the output is shorter than min_tokens): stop strings are not looked for."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(may_stop)

    def _release(self, may_stop: bool) -> tuple[str, str | None]:
        if not self.stop or not may_stop:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, None
        hit, found = -1, ""
        for s in self.stop:
            i = self.text.find(s, self.sent)
            if i >= 0 and (hit < 0 or i < hit):
                hit, found = i, s
        if hit >= 0:
            out, self.sent = self.text[self.sent : hit + len(found) if self.include_stop else hit], len(self.text)
            return out, found
        pending = self.text[self.sent :]
        hold = 0
        for k in range(min(max(map(len, self.stop)) - 1, len(pending)), 0, -1):
            if any(s.startswith(pending[-k:]) for s in self.stop):
                hold = k
                break
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent : end], end
        return out, None

    def flush(self) -> str:
        """At the end (no stop string can follow): whatever was held back, incomplete characters included."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
