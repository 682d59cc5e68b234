"""The engine thread: schedule → step → sample → stream, forever.

The model step runs here, never on the asyncio loop, so streaming, loads and
health stay responsive while the accelerator (or the CPU) computes. The loop
talks to the engine through two thread-safe inboxes (new sequences,
cancellations); the engine talks back with one `call_soon_threadsafe` per
step carrying every event of that step, sent when the next step's kernels
start (or at once when there is no next step), so the loop's work on them
overlaps the kernels instead of contending with the engine for the GIL.

Cancellation and deadlines are checked before every step: a cancelled or
expired sequence leaves the batch at the next step and its KV blocks are
freed at once.

Bursts: a batch of decodes of plain greedy sequences (no logprobs) with
nobody waiting runs several steps in one call where the runner can
(`ModelRunner.decode_steps`: on CPU, each row's argmax fed back in C), as
many as fit in `burst_s` by the last step's time: the ~0.4 ms of Python
between two steps is paid once per burst. A request or a cancel that arrives
ends the burst after its current step (`Interrupt`); the earliest deadline
ends it too. The tokens are those of single steps; streams get them a burst
at a time.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bitdelta.generation import ArrivalState, FinishReason, Logprobs, TokenEvent, TokenLogprob, Ttft, Usage
from bitdelta_kernels.cpu_decode import Interrupt
from services.gpu_worker.runner import ModelRunner, SeqWork
from services.gpu_worker.sampling import Sampler, TextStream
from services.gpu_worker.scheduler import Scheduler, SeqState

log = logging.getLogger("gpu_worker.engine")

# How long an idle engine sleeps before re-checking deadlines.
IDLE_POLL_S = 0.05
# The most steps one burst runs.
MAX_BURST = 64


@dataclass
class Sequence:
    """Engine-side state of one request (the scheduler's `SeqState` plus sampling and streaming)."""

    state: SeqState
    sampler: Sampler
    text: TextStream
    eos_ids: frozenset[int]
    emit: Callable[[object], None]  # called on the loop with a TokenEvent or an Exception
    delta_name: str | None  # the slot reference to release when the sequence leaves
    arrival: ArrivalState  # the delta's state when the request arrived (sent with the first token)
    t_arrival: float  # perf_counter() when the request arrived
    delta_load_ms: float = 0.0
    deadline: float | None = None  # time.monotonic() deadline
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_sched: float | None = None
    prefill_batch: int = 0  # sequences in the step that first scheduled this one (traces)
    sent_first: bool = False
    index: int = 0  # the request's choice (Sampling.n)
    forks: list[Sequence] = field(default_factory=list)  # its other choices, started once the prompt is cached
    prompt_lps: list[Logprobs] = field(default_factory=list)  # Sampling.prompt_logprobs: prompt tokens 1.. so far


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        loop,
        release: Callable[[str], None],
        burst_s: float = 0.0,
    ):
        self.runner, self.scheduler, self.loop = runner, scheduler, loop
        # a burst's length in steps of the last step's time (0: one step a call; a runner without
        # bursts takes no KV blocks ahead for them)
        self.burst_s = burst_s if runner.bursts else 0.0
        self._step_s = math.inf  # the last step's time (a burst's: per step)
        self.interrupt = Interrupt()  # set when a request or a cancel arrives: a burst ends
        self._release = release  # manager.release, called on the loop
        self._inbox: deque[Sequence] = deque()
        self._cancels: deque[int] = deque()
        self._seqs: dict[int, Sequence] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0  # steps run so far: the tests check that sequences share steps
        self.bursts = 0  # calls that ran more than one step
        self.prefill_tokens = 0  # prompt tokens put through the model (n choices share one prefill)

    # -- from the loop (thread-safe) -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        with self._cv:
            self._inbox.append(seq)
            self.interrupt.set()
            self._cv.notify()

    def cancel(self, seq_id: int) -> None:
        with self._cv:
            self._cancels.append(seq_id)
            self.interrupt.set()
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self.interrupt.set()
            self._cv.notify()
        self._thread.join(timeout=30)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # Triton launches on the current device
        # A step's events go to the loop once the NEXT step's inputs are built and its kernels start
        # (`runner.forward`'s ready), or as soon as the engine has nothing to run: the loop's Python
        # for them (streams, messages, metrics) then runs while the kernels run without the GIL,
        # instead of holding the GIL while this thread builds the next step (~0.3 ms a token that
        # this thread waited, a few % of a small model's step on CPU). The overlap vLLM's async
        # output processing makes.
        pending: list[tuple[Callable, object]] = []

        def ready() -> None:
            nonlocal pending
            if pending:
                self.loop.call_soon_threadsafe(_deliver, pending)
                pending = []

        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self._cancels and not self.scheduler.has_work():
                    ready()
                    self._cv.wait()
                if self._stop:
                    break
                new = list(self._inbox)
                self._inbox.clear()
                cancels = list(self._cancels)
                self._cancels.clear()
            posts: list[tuple[Callable, object]] = []
            for s in new:
                self._seqs[s.state.seq_id] = s
                self.scheduler.add(s.state)
            now = time.monotonic()
            for sid in cancels:
                self._drop(sid, posts, None)
            for sid, s in list(self._seqs.items()):
                if s.deadline is not None and now >= s.deadline:
                    self._drop(sid, posts, FinishReason.CANCELLED)
            work = []
            try:
                work = self.scheduler.schedule()
                if work:
                    n = self._burst_len(work)
                    if n <= 1 or not self._burst(work, n, posts, ready):
                        self._step(work, posts, ready)
                elif self.scheduler.has_work():
                    ready()
                    with self._cv:  # waiting for KV space that only a cancel/deadline can free
                        self._cv.wait(IDLE_POLL_S)
            except Exception as e:  # fail this batch, keep serving the rest
                log.exception("step failed")
                for w in work:
                    self._drop(w.seq.seq_id, posts, None, error=e)
            ready()  # where the step did not reach its kernels
            pending = posts
        # shutting down: every open request ends
        posts = pending
        for sid in list(self._seqs):
            self._drop(sid, posts, None, error=RuntimeError("the worker is shutting down"))
        if posts and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_deliver, posts)

    def _step(self, work, posts, ready: Callable[[], None] | None = None) -> None:
        t0 = time.perf_counter()
        batch, echoed = [], []  # echoed: (sequence, first position) of the prompt logits rows, in work order
        for w in work:
            s = w.seq
            seq = self._seqs[s.seq_id]
            if seq.t_first_sched is None:
                seq.t_first_sched = t0
                seq.prefill_batch = len(work)
            # from 0 when LongRoPE switches to its long factors in this step (its cached keys change)
            start = self.runner.args.rope.step_start(s.computed, w.n_tokens)
            toks = s.tokens[start : s.computed + w.n_tokens]
            first = None
            lo = max(s.computed, len(seq.prompt_lps))  # rows echoed before a preemption: not again
            if seq.sampler.sampling.prompt_logprobs is not None and not s.output and lo < s.computed + w.n_tokens:
                first = lo - start  # the new tokens' rows each predict the next prompt token
                echoed.append((seq, lo, s.computed + w.n_tokens - int(w.samples) - lo))
            prefill = s.computed < len(s.prompt)  # prompt tokens, even a chunk of one
            batch.append(SeqWork(toks, start, s.slot, s.blocks, w.samples, first, prefill))
            self.prefill_tokens += max(0, min(w.n_tokens, len(s.prompt) - s.computed))
        logits = self.runner.forward(batch, ready)  # [R, vocab] fp32, rows of the sampling sequences in order
        self._step_s = time.perf_counter() - t0
        seqs = [self._seqs[w.seq.seq_id] for w in work if w.samples]
        if echoed:
            self._prompt_logprobs(logits[len(seqs) :], echoed)
            logits = logits[: len(seqs)]
        rows = list(range(len(seqs)))  # each sampling sequence's row of the logits
        for r, seq in enumerate(list(seqs)):  # a prompt cached in this step: its other choices start here
            if seq.forks and not seq.state.output:
                for child in seq.forks:
                    self._fork(seq, child)
                    seqs.append(child)
                    rows.append(r)
                seq.forks, seq.state.forks = [], 0
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        samplers = [seq.sampler for seq in seqs]
        picks = _greedy(logits)
        hot = [i for i, sp in enumerate(samplers) if not sp.plain]  # rows with their own rule
        failed: dict[int, Exception] = {}  # sampling row -> why it could not be sampled
        if hot:
            rows = logits[torch.tensor(hot, device=logits.device)].cpu()
            for j, i in enumerate(hot):
                try:
                    picks[i] = samplers[i].sample(rows[j])
                except Exception as e:  # this sequence ends alone; the batch goes on
                    failed[i] = e
        raw = self._raw_logprobs(logits, samplers, picks)
        t1 = time.perf_counter()
        self.steps += 1
        for w in work:
            self.scheduler.advance(w.seq, w.n_tokens)
        for r, seq in enumerate(seqs):
            sid, tok = seq.state.seq_id, picks[r]
            if r in failed:
                log.warning("sequence %d: %s", sid, failed[r])
                self._drop(sid, posts, None, error=failed[r])
                continue
            try:
                self._emit_token(seq, tok, t1, posts, raw.get(r))
            except Exception as e:  # e.g. detokenising: end this sequence, not the batch
                log.exception("sequence %d: emitting token %d failed", sid, tok)
                self._drop(sid, posts, None, error=e)

    def _burst_len(self, work) -> int:
        """Steps the next call may run: as many as fit in `burst_s` by the last step's time, for a
        batch of decodes of plain greedy sequences that want no logprobs, with nobody waiting, and
        free KV blocks for each one's burst (taken here); else 1."""
        n = min(MAX_BURST, int(self.burst_s / self._step_s))
        if n <= 1:
            return 1
        self.interrupt.clear()  # before the inboxes are read: an arrival after this sets it again
        if self._inbox or self._cancels or self.scheduler.waiting:
            return 1
        for w in work:
            s, seq = w.seq, self._seqs[w.seq.seq_id]
            sp = seq.sampler
            if w.n_tokens != 1 or not w.samples or not s.output or seq.forks:
                return 1
            if not sp.plain or sp.sampling.logprobs is not None:
                return 1
            n = min(n, s.max_new - len(s.output))
        return n if n > 1 and self.scheduler.reserve([w.seq for w in work], n) else 1

    def _burst(self, work, n: int, posts, ready: Callable[[], None]) -> bool:
        """Up to n decode steps of `work` in one call (`ModelRunner.decode_steps`), each token
        emitted as `_step` emits it; False where the runner does not take the batch so (nothing
        ran)."""
        t0 = time.perf_counter()
        batch = [SeqWork(w.seq.tokens[w.seq.computed :], w.seq.computed, w.seq.slot, w.seq.blocks, True) for w in work]
        deadline = min((d for w in work if (d := self._seqs[w.seq.seq_id].deadline) is not None), default=None)
        burst = self.runner.decode_steps(batch, n, self.interrupt, deadline, ready)
        if burst is None:
            return False
        done = len(burst.times)
        self._step_s = (time.perf_counter() - t0) / done
        self.steps += done
        self.bursts += done > 1
        seqs = [self._seqs[w.seq.seq_id] for w in work]
        for i, t in enumerate(burst.times):  # each token with the time its step picked it
            for seq, row in zip(seqs, burst.tokens):
                sid = seq.state.seq_id
                if sid not in self._seqs:  # it ended earlier in the burst: the rest of its row is dropped
                    continue
                self.scheduler.advance(seq.state, 1)
                try:
                    self._emit_token(seq, row[i], t, posts)
                except Exception as e:  # e.g. detokenising: end this sequence, not the batch
                    log.exception("sequence %d: emitting token %d failed", sid, row[i])
                    self._drop(sid, posts, None, error=e)
        return True

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Start choice `child` on `parent`'s cached prompt (scheduler.fork), copying the prompt's
        partly filled last block into the child's own."""
        copy = self.scheduler.fork(parent.state, child.state)
        if copy is not None:
            self.runner.kv.copy_rows(*copy)
        child.t_first_sched, child.prefill_batch = parent.t_first_sched, parent.prefill_batch
        self._seqs[child.state.seq_id] = child

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, samplers, picks: list[int]) -> dict[int, tuple]:
        """sampling row -> (logprob of its pick, [(id, logprob)] of its top alternatives), for the rows
        that asked (Sampling.logprobs), from the raw logits: before penalties, masks, temperature."""
        want = [i for i, sp in enumerate(samplers) if sp.sampling.logprobs is not None]
        if not want:
            return {}
        lp = torch.log_softmax(logits[torch.tensor(want, device=logits.device)].float(), -1)  # [W, vocab]
        chosen = lp.gather(1, torch.tensor([picks[i] for i in want], device=lp.device)[:, None])[:, 0].tolist()
        k = max(samplers[i].sampling.logprobs for i in want)
        top_v, top_i = (t.tolist() for t in lp.topk(k, -1)) if k else ([[]] * len(want), [[]] * len(want))
        return {
            i: (chosen[j], list(zip(top_i[j], top_v[j]))[: samplers[i].sampling.logprobs]) for j, i in enumerate(want)
        }

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, echoed) -> None:
        """Each echoed sequence's rows of `logits` (in order) -> its next prompt tokens' Logprobs."""
        lp = torch.log_softmax(logits.float(), -1)  # [P, vocab]: the raw logits, as the sampled tokens'
        r = 0
        for seq, pos, n in echoed:
            s = seq.state
            want = torch.tensor(s.prompt[pos + 1 : pos + 1 + n], device=lp.device)
            rows = lp[r : r + n]
            r += n
            if not n:
                continue
            got = rows.gather(1, want[:, None])
            rank = (rows >= got).sum(1).tolist()  # as vLLM's: every token at least as likely, itself included
            chosen = got[:, 0].tolist()
            k = seq.sampler.sampling.prompt_logprobs
            top_v, top_i = (t.tolist() for t in rows.topk(k, -1)) if k else ([[]] * n, [[]] * n)
            for j in range(n):
                raw = (chosen[j], list(zip(top_i[j], top_v[j])))
                seq.prompt_lps.append(_logprobs(seq, s.prompt[pos + 1 + j], raw, rank[j]))

    def _emit_token(self, seq: Sequence, tok: int, now: float, posts, raw: tuple | None = None) -> None:
        s = seq.state
        sp = seq.sampler.sampling
        s.output.append(tok)
        may_stop = len(s.output) >= sp.min_tokens  # as vLLM: the min_tokens-th token may end it
        finish = None
        stop_reason: str | int | None = None  # vLLM's: the stop token or string that ended it
        eos = tok in seq.eos_ids and not sp.ignore_eos
        if (tok in sp.stop_token_ids or eos) and may_stop:  # its text only with include_stop_str_in_output
            text = seq.text.add(tok)[0] if sp.include_stop_str_in_output else ""
            text += seq.text.flush()
            finish = FinishReason.STOP if tok in sp.stop_token_ids else FinishReason.EOS
            stop_reason = tok if finish is FinishReason.STOP else None
        else:
            text, stop_reason = seq.text.add(tok, may_stop)
            if stop_reason is not None:
                finish = FinishReason.STOP
            elif eos:
                finish = FinishReason.EOS
            elif len(s.output) >= s.max_new:
                finish = FinishReason.LENGTH
            if finish is not None and finish is not FinishReason.STOP:
                text += seq.text.flush()
        ttft = None
        if not seq.sent_first:
            seq.sent_first = True
            ttft = Ttft(
                delta_load_ms=seq.delta_load_ms,
                schedule_ms=(seq.t_first_sched - seq.t_submit) * 1e3,
                prefill_ms=(now - seq.t_first_sched) * 1e3,
                total_ms=(now - seq.t_arrival) * 1e3,
            )
        ev = TokenEvent(
            tok,
            text,
            (now - seq.t_arrival) * 1e3,
            finish_reason=finish,
            usage=Usage(len(s.prompt), len(s.output)) if finish is not None else None,
            stop_reason=stop_reason,
            ttft=ttft,
            arrival=seq.arrival if ttft is not None else None,
            prefill_batch=seq.prefill_batch if ttft is not None else 0,
            logprobs=None if raw is None else _logprobs(seq, tok, raw),
            index=seq.index,
            prompt_logprobs=_echo(seq) if ttft is not None else (),
            prompt_token_ids=tuple(s.prompt) if ttft is not None and sp.return_prompt_token_ids else (),
        )
        posts.append((seq.emit, ev))
        if finish is not None:
            self._drop(s.seq_id, posts, None, notify=False)

    def _drop(
        self,
        seq_id: int,
        posts,
        finish: FinishReason | None,
        error: Exception | None = None,
        notify: bool = True,
    ) -> None:
        """Remove a sequence from the batch, free its KV blocks and its slot reference."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq_id)
        for child in seq.forks:  # choices not started yet end with it
            self._seqs[child.state.seq_id] = child
            self._drop(child.state.seq_id, posts, finish, error, notify)
        seq.forks = []
        if seq.delta_name is not None:
            posts.append((self._release, seq.delta_name))
        if error is not None:
            posts.append((seq.emit, error))
        elif notify and finish is not None:
            s = seq.state
            ev = TokenEvent(
                s.output[-1] if s.output else 0,
                seq.text.flush(),
                (time.perf_counter() - seq.t_arrival) * 1e3,
                finish_reason=finish,
                usage=Usage(len(s.prompt), len(s.output)),
                index=seq.index,
            )
            posts.append((seq.emit, ev))


def _greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, NaN above all, as torch's). A host's fp32
    rows go through numpy, whose argmax is vectorized: ~4 µs a 49152-wide row where torch's takes
    ~48 (0.3 ms of an 8-row CPU step)."""
    if not logits.shape[0]:
        return []
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def _echo(seq: Sequence) -> tuple[Logprobs, ...]:
    """The first event's prompt logprobs (Sampling.prompt_logprobs): the first prompt token's is NaN."""
    if seq.sampler.sampling.prompt_logprobs is None:
        return ()
    t0 = seq.state.prompt[0]
    first = Logprobs(TokenLogprob(t0, seq.text.tok.decode([t0], skip_special_tokens=False), math.nan))
    return (first, *seq.prompt_lps)


def _logprobs(seq: Sequence, tok: int, raw: tuple, rank: int = 0) -> Logprobs:
    """The event's Logprobs: each token decoded alone (special tokens as their text)."""
    text = lambda t: seq.text.tok.decode([t], skip_special_tokens=False)
    chosen, top = raw
    return Logprobs(TokenLogprob(tok, text(tok), chosen), tuple(TokenLogprob(t, text(t), v) for t, v in top), rank)


def _deliver(posts) -> None:
    for fn, arg in posts:
        fn(arg)
