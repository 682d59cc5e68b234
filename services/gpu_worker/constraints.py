"""Constrained decoding on the worker: grammars compiled for the base's tokenizer, and the per-row
mask the sampler applies (llguidance; bitdelta/grammar.py says what each constraint compiles to).

    compiler = GrammarCompiler(base_dir / "tokenizer.json", vocab_size, eos_ids)
    g = await compiler.compile(constraint)        # off the loop and the engine thread; cached
    state = g.start()                             # one per sequence (each choice its own)
    state.mask(row)                               # row: fp32 [vocab]; disallowed tokens -> -inf
    state.accept(token)                           # the matcher advances with the picked token

EOS is one of the tokens the grammar allows exactly where the output is complete (the tokenizer's
EOS set is the worker's); once the grammar admits nothing more, EOS is all it allows.

Why the masks are computed on the engine thread, in the step: the mask depends on the token just
picked, llguidance computes one in tens of microseconds for a JSON schema (bench/gateway.py), and
only constrained rows pay it; unconstrained rows of the same batch never see it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import llguidance
import numpy as np
import torch

from bitdelta import grammar as grammars
from bitdelta.generation import Constraint, GenerationError
from services.gpu_worker.errors import SamplingError

log = logging.getLogger("gpu_worker.constraints")

MAX_CACHED = 256  # compiled grammars kept (an LRU keyed by the constraint)


class ConstraintError(SamplingError):
    """The request's grammar failed while decoding (e.g. it grew past llguidance's per-step limits):
    the request's fault, so INVALID_ARGUMENT, naming the constraint."""

    code = grpc.StatusCode.INVALID_ARGUMENT


def _mask_words(n_vocab: int) -> np.ndarray:
    """llguidance's mask buffer: bit j of word i says whether token 32 i + j is allowed."""
    return np.zeros((n_vocab + 31) // 32, dtype=np.int32)


def _allowed(matcher: llguidance.LLMatcher, bits: np.ndarray, n_vocab: int) -> np.ndarray:
    """bool [n_vocab]: the tokens `matcher` allows next (computed into `bits`)."""
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:n_vocab].view(np.bool_)


class Grammar:
    """One constraint compiled for the worker's tokenizer: a pristine matcher copied per sequence."""

    def __init__(self, constraint: Constraint, matcher: llguidance.LLMatcher, n_vocab: int, compile_ms: float):
        self.constraint, self._matcher, self.n_vocab, self.compile_ms = constraint, matcher, n_vocab, compile_ms

    def start(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self.n_vocab)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int):
        self.matcher, self.n = matcher, n_vocab
        self._bits = _mask_words(n_vocab)

    def mask(self, row: torch.Tensor) -> None:
        """row: fp32 [vocab] on the CPU, contiguous, in place: every token the grammar does not allow
        next is -inf. In numpy (one thread): torch's masked_fill wakes its thread pool, which on a
        busy CPU cost milliseconds per row where this costs tens of microseconds."""
        allowed = _allowed(self.matcher, self._bits, self.n)
        if self.matcher.is_error() or not allowed.any():
            raise ConstraintError(f"sampling.constraint: allows no next token ({self.matcher.get_error() or 'none'})")
        out = row.numpy()
        n = min(self.n, out.shape[0])
        out[:n][~allowed[:n]] = -np.inf
        out[n:] = -np.inf  # the model's padding rows beyond the tokenizer's vocabulary

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"sampling.constraint: failed at token {token}: {self.matcher.get_error()[:500]}")


class GrammarCompiler:
    """Compiles constraints for one tokenizer, each once (an LRU of `MAX_CACHED`), on threads of its
    own: a large schema never holds the event loop, the engine's step or another request's compile
    (llguidance releases the GIL while it builds). Concurrent requests for one constraint share
    one compile."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids, max_cached: int = MAX_CACHED):
        self._path, self._vocab, self._eos = str(tokenizer_json), vocab_size, sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on the first constrained request
        self._tok_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._cache: collections.OrderedDict[Constraint, asyncio.Future] = collections.OrderedDict()
        self._max = max_cached
        self.compiled = 0  # compiles run (the tests check the cache)

    def _tokenizer_of(self) -> llguidance.LLTokenizer:
        with self._tok_lock:
            if self._tokenizer is None:
                t = time.perf_counter()
                self._tokenizer = llguidance.LLTokenizer(self._path, n_vocab=self._vocab, eos_token=self._eos)
                log.info("grammar tokenizer ready in %.0f ms", (time.perf_counter() - t) * 1e3)
            return self._tokenizer

    def _build(self, c: Constraint) -> Grammar:
        t = time.perf_counter()
        text = grammars.check(c)
        m = llguidance.LLMatcher(self._tokenizer_of(), text, log_level=0, limits=grammars.limits())
        if not m.is_error():  # a first step, on a copy: a grammar too big for llguidance's per-step limits fails here
            probe = m.deep_copy()
            allowed = np.flatnonzero(_allowed(probe, _mask_words(self._vocab), self._vocab))
            first = int(allowed[0]) if len(allowed) else -1
            if first >= 0 and first not in self._eos:
                probe.consume_token(first)
            if probe.is_error():
                m = probe
        if m.is_error():
            raise GenerationError(
                "sampling.constraint", f"the {c.kind.value} is too large or cannot be used: {m.get_error()[:500]}"
            )
        self.compiled += 1
        return Grammar(c, m, self._vocab, (time.perf_counter() - t) * 1e3)

    async def compile(self, c: Constraint) -> Grammar:
        """The compiled grammar, or GenerationError (INVALID_ARGUMENT) naming what is wrong."""
        fut = self._cache.get(c)
        if fut is None:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._build, c)
            self._cache[c] = fut
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(c)
        try:
            return await asyncio.shield(fut)  # one request cancelled never cancels the others' compile
        except Exception:
            if self._cache.get(c) is fut:  # errors are not cached: the next request tries again
                del self._cache[c]
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
