"""Picking tokens and turning them into text.

- `Sampler`: greedy (temperature 0), or temperature + nucleus (top-p) with a
  per-request generator: same seed, same tokens, whatever else is in the batch.
- `TextStream`: incremental detokenisation (decode a short window around the
  new token so multi-byte characters and leading spaces come out right) and
  stop strings: text that could still become a stop string is held back, and
  the stop string itself is never returned.
"""

from __future__ import annotations

import math
import os

import torch

from bitdelta.generation import Sampling
from services.gpu_worker.errors import SamplingError


class Sampler:
    def __init__(self, sampling: Sampling):
        self.temperature = float(sampling.temperature)
        self.top_p = float(sampling.top_p)
        self.greedy = sampling.greedy
        self.generator = None
        if not self.greedy:
            seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor) -> int:
        """logits: fp32 [vocab] on the CPU -> token id. Raises SamplingError (this sequence only)
        when the probabilities are not finite: a NaN or infinite temperature or top_p, a temperature
        so small that logits / temperature overflows, or non-finite logits."""
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise self._error("the sampling parameters are not finite")
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise self._error("the token probabilities are not finite")
        if 0.0 < self.top_p < 1.0:
            p, idx = probs.sort(descending=True)
            cum = p.cumsum(0)
            keep = (cum - p) < self.top_p  # the smallest prefix whose mass reaches top_p (never empty)
            p = p * keep
            choice = torch.multinomial(p / p.sum(), 1, generator=self.generator)
            return int(idx[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _error(self, what: str) -> SamplingError:
        return SamplingError(
            f"cannot sample the next token: {what} (temperature={self.temperature!r}, "
            f"top_p={self.top_p!r}); use temperature 0 (greedy) or a finite temperature "
            "of at least 1e-3, and top_p in [0, 1]"
        )


class TextStream:
    """Token ids in, text pieces out (see module docstring)."""

    def __init__(self, tokenizer, prompt: list[int], stop: list[str]):
        self.tok = tokenizer
        self.ids = list(prompt)
        self.prefix_offset = max(len(prompt) - 5, 0)
        self.read_offset = len(prompt)
        self.stop = [s for s in stop if s]
        self.text = ""  # generated text so far (decoded)
        self.sent = 0  # characters of `text` already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> tuple[str, bool]:
        """Append one token. Returns (text to send now, whether a stop string was produced)."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def _release(self) -> tuple[str, bool]:
        if not self.stop:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, False
        hit = -1
        for s in self.stop:
            i = self.text.find(s, self.sent)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            out, self.sent = self.text[self.sent : hit], len(self.text)
            return out, True
        pending = self.text[self.sent :]
        hold = 0
        for k in range(min(max(map(len, self.stop)) - 1, len(pending)), 0, -1):
            if any(s.startswith(pending[-k:]) for s in self.stop):
                hold = k
                break
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        """At the end (no stop string can follow): whatever was held back, incomplete characters included."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
