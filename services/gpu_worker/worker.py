"""The worker's core: base weights, delta slots, KV pool and engine behind
plain Python methods (the servicer only translates protobuf to these).

    worker = Worker(config); await worker.start()
    async for ev in worker.generate(Request(model_id="coder", prompt="def f(")): ...   # TokenEvents
    async for ready in worker.stream(request): ...   # lists: every TokenEvent ready when asked
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from opentelemetry import trace

from bitdelta.arch import ModelArgs
from bitdelta.cache_policy import WeightedLRUPolicy
from bitdelta.checkpoint import fingerprint, read_config
from bitdelta.generation import ArrivalState, Request, TokenEvent, check_model_id
from bitdelta.model_files import eos_token_ids
from bitdelta.rpc import telemetry
from bitdelta.rpc.streams import first_alone, take_ready
from bitdelta_kernels.settings import configure as configure_kernels
from bitdelta_kernels.settings import current as kernel_settings
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.constraints import GrammarCompiler
from services.gpu_worker.engine import Engine, Sequence
from services.gpu_worker.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.gpu_worker.manager import DeltaEntry, DeltaManager, DeltaState, SlotInfo
from services.gpu_worker.runner import BaseWeights, KVPool, ModelRunner
from services.gpu_worker.sampling import Sampler, TextStream, bad_word_ids
from services.gpu_worker.scheduler import BlockAllocator, Scheduler, SeqState, cache_root
from services.gpu_worker.slots import SlotLayout, SlotTensors
from services.gpu_worker.sources import source_of

log = logging.getLogger("gpu_worker")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkerStatus:
    base_model: str
    base_fingerprint: str
    device: str
    slots: list[SlotInfo]
    delta_budget_bytes: int
    delta_used_bytes: int
    running: int
    waiting: int
    kv_tokens_used: int
    kv_tokens_total: int
    preemptions: int = 0  # sequences whose KV blocks were taken back (recomputed later)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, found (not computed again)
    tensor_parallel: int = 1
    ranks: tuple = ()  # parallel.RankInfo per rank (tensor parallelism)


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        dev = config.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        dt = config.dtype
        if dt == "auto":  # bitdelta.precision: bf16 on CUDA and on CPUs with native bf16, else fp32
            from bitdelta.precision import serving_dtype

            chosen = serving_dtype(self.device)
            dt = chosen.torch_name
            log.info("dtype auto: %s", chosen.describe())
        self.dtype = DTYPES[dt]
        # --kernel-backend, else the process's kernel settings (BITDELTA_KERNEL_BACKEND), fixed here
        self.kernel_backend = config.kernel_backend or kernel_settings().backend
        log.info("kernels: backend %s", self.kernel_backend)
        # --batch-invariant, else the process's kernel settings (BITDELTA_BATCH_INVARIANT)
        self.batch_invariant = config.batch_invariant or kernel_settings().batch_invariant
        self._kernels_before = None  # the process's kernel settings to restore at close, if start changed them
        cfg = read_config(config.base)
        self.base_name = config.base_name or cfg.get("_name_or_path") or Path(config.base).name
        self.ready = False
        self.draining = False
        self._ids = itertools.count(1)
        self.base_fingerprint = ""
        self.manager: DeltaManager | None = None
        self.engine: Engine | None = None
        self.source = None
        self.grammars: GrammarCompiler | None = None
        # variants' own tokenizers: a grammar compiler each (tokenizer sha256, EOS ids, vocabulary), their files here
        self._variant_grammars: dict[tuple[str, tuple[int, ...], int], GrammarCompiler] = {}
        self._own_dir: tempfile.TemporaryDirectory | None = None
        self.tp = None  # parallel.Driver with --tensor-parallel N > 1
        self.fatal = ""  # why the worker stopped serving for good (a tensor-parallel rank failed)
        self.on_fatal = self.begin_drain  # serve(): stop the process (SIGTERM to itself)
        if config.tensor_parallel > 1:  # rank 0: cuda:LOCAL_RANK, LOCAL_RANK 0 unless torchrun says so
            from services.gpu_worker.parallel import Rendezvous, rank_device

            rv = Rendezvous.from_env()
            self.device = rank_device(config, rv.local_rank if rv is not None else 0)
        if self.batch_invariant:
            self._check_batch_invariant()
            self.kernel_backend = "cpu"  # not auto: with Triton's interpreter on, auto picks it for small calls
        if config.cuda_graphs and ModelArgs.from_hf(cfg).family.moe is not None:
            raise ValueError(
                "--cuda-graphs: a mixture-of-experts layer routes its rows on the host, which a graph cannot"
            )
        if config.cuda_graphs and (self.device.type != "cuda" or config.tensor_parallel > 1):
            where = "tensor-parallel ranks" if config.tensor_parallel > 1 else f"device {self.device}"
            raise ValueError(f"--cuda-graphs: CUDA graphs need one CUDA device's own runner, not {where}")

    def _check_batch_invariant(self) -> None:
        """Refuse what batch-invariant serving cannot give (only the C CPU kernels have per-row paths)."""
        from bitdelta_kernels.cpu_build import load_cpu_lib

        why = ""
        if self.device.type != "cpu":
            why = f"it runs on the CPU kernels only, and this worker's device is {self.device}"
        elif self.kernel_backend not in ("auto", "cpu"):
            why = f"it runs on the C CPU kernels, and the kernel backend is {self.kernel_backend!r}"
        elif self.config.tensor_parallel > 1:
            why = "tensor-parallel ranks do not have it"
        elif load_cpu_lib() is None:
            why = "the C CPU kernels did not build or are switched off (BITDELTA_CPU_KERNELS=0)"
        if why:
            raise ValueError(f"--batch-invariant: {why}")

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the base (off the loop), allocate slots and the KV pool, compile the kernels
        (CUDA), start the engine."""
        c = self.config
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        if self.batch_invariant and not kernel_settings().batch_invariant:  # the kernels read it per call
            self._kernels_before = configure_kernels(dataclasses.replace(kernel_settings(), batch_invariant=True))
        if self.device.type == "cuda":
            from bitdelta_kernels.dispatch import HAVE_TRITON, TRITON_ERROR

            if not HAVE_TRITON and not c.allow_slow_kernels:
                # the fallback materialises an fp32 ±1 matrix per call: ~10x slower, and silent
                raise RuntimeError(
                    f"the Triton kernels cannot be imported on this CUDA machine ({TRITON_ERROR}); "
                    "install the triton that matches torch, or pass --allow-slow-kernels to serve "
                    "with the torch reference kernels"
                )
            if not HAVE_TRITON:
                log.warning("Triton unavailable (%s): serving with the slow torch reference kernels", TRITON_ERROR)
        self.base_fingerprint = await asyncio.to_thread(fingerprint, c.base)
        if c.tensor_parallel > 1:  # this rank's shards; ranks 1..N-1 start beside it (parallel.py)
            from services.gpu_worker.parallel import Rendezvous, start_driver

            def failed(why: str) -> None:  # on the engine's or the heartbeat's thread
                loop.call_soon_threadsafe(self._tp_failed, why)

            rv = Rendezvous.from_env()  # torchrun's, else None: rank 0 starts the other ranks itself
            self.tp = await asyncio.to_thread(start_driver, c, self.dtype, failed, self.kernel_backend, rv)
            m = self.tp.model
            self.base, self.args, self.layout, self.slots, self.kv = m.base, m.args, m.layout, m.slots, m.kv
            self.runner = self.tp  # the engine's runner: broadcasts each step, then runs it on rank 0's shards
            n_slots, n_blocks = m.slots.n_slots, m.kv.n_blocks
        else:
            self.base, self.args = await asyncio.to_thread(BaseWeights.load, c.base, self.dtype, self.device)
            self.layout = SlotLayout(self.args, self.dtype)
            n_slots = c.max_slots or c.delta_budget // self.layout.slot_bytes
            self.slots = await asyncio.to_thread(
                SlotTensors.allocate,
                self.layout,
                n_slots,
                self.device,
                self.base.norms,
                self.base.final_norm,
                self.base.biases,
                self.base.final_norm_bias,
                self.base.head_bias,
            )
            kv_tokens = c.kv_cache // KVPool.bytes_per_token(self.args, self.dtype)
            n_blocks = kv_tokens // c.block_size
            if n_blocks < 1:
                raise ValueError(f"--kv-cache {c.kv_cache} bytes holds less than one block of {c.block_size} tokens")
            self.kv = KVPool(self.args, n_blocks, c.block_size, self.dtype, self.device)
            self.runner = ModelRunner(
                self.base,
                self.args,
                self.slots,
                self.kv,
                use_fused=c.fused_single_variant,
                backend=self.kernel_backend,
                batch_invariant=self.batch_invariant,
            )
        # A length-dependent rope (dynamic, LongRoPE) gives a token's K/V that depends on the sequence's
        # length when it was computed (LongRoPE even recomputes them): its blocks are not reusable.
        prefix = c.prefix_caching and not self.args.rope.length_dependent
        if c.prefix_caching and not prefix:
            log.info("prefix caching off: the %s rope's keys depend on the sequence's length", self.args.rope.kind)
        self.scheduler = Scheduler(
            BlockAllocator(n_blocks),
            c.block_size,
            c.max_running,
            c.max_batch_tokens,
            prefix_caching=prefix,
            cache_generated=not self.batch_invariant,
        )
        self.source = source_of(c, self.tp.model.tp if self.tp is not None else None)
        policy = WeightedLRUPolicy(c.delta_budget, half_life_s=c.rate_half_life_s, pin_top_n=c.pin_hottest)
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.manager = DeltaManager(
            self.layout,
            self.slots,
            self.source,
            self.base_fingerprint,
            c.delta_budget,
            policy,
            load_stream=stream,
            shard=self.tp.model.shard_load if self.tp is not None else None,
            peers=self.tp,
        )
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(c.base) / "tokenizer.json"))
        self.eos_ids = eos_token_ids(c.base)
        self.grammars = GrammarCompiler(Path(c.base) / "tokenizer.json", self.args.vocab_size, self.eos_ids)
        if self.device.type == "cuda":  # compile every kernel binary now: TTFT never pays a JIT
            tw = time.perf_counter()
            ran = await asyncio.to_thread(self.runner.warmup, c.max_batch_tokens, c.max_running)
            log.info("kernels warmed up: %d step shapes in %.1f s", len(ran), time.perf_counter() - tw)
            if c.cuda_graphs:  # decode steps' layers as CUDA graphs (graphs.py): every bucket's now
                from services.gpu_worker.graphs import DecodeGraphs

                tw = time.perf_counter()
                self.runner.graphs = DecodeGraphs(self.runner, c.max_running)
                shapes = await asyncio.to_thread(self.runner.graphs.warm)
                log.info("CUDA graphs captured: %d decode shapes in %.1f s", len(shapes), time.perf_counter() - tw)
        self.engine = Engine(self.runner, self.scheduler, loop, self.manager.release, c.decode_burst_ms / 1e3)
        self.engine.start()
        self.ready = True
        log.info(
            "worker ready: base %s (%s, %.0f MB) on %s %s, %d delta slots (%d bytes each), %d KV tokens, in %.1f s",
            self.base_name,
            self.base_fingerprint[:12],
            self.base.nbytes / 1e6,
            self.device,
            str(self.dtype).removeprefix("torch."),
            n_slots,
            self.layout.slot_bytes,
            n_blocks * c.block_size,
            time.perf_counter() - t0,
        )

    def begin_drain(self) -> None:
        self.draining = True

    def _tp_failed(self, why: str) -> None:
        """A rank died or hung (on the loop): the worker stops serving and stops (`on_fatal`)."""
        if not self.fatal:
            self.fatal = why
            self.draining = True
            self.on_fatal()

    async def close(self) -> None:
        self.ready = False
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.tp is not None:
            await asyncio.to_thread(self.tp.stop)
        if self.source is not None:
            await self.source.close()
        if self.grammars is not None:
            self.grammars.close()
        for g in self._variant_grammars.values():
            g.close()
        if self._own_dir is not None:
            self._own_dir.cleanup()
        if self._kernels_before is not None:
            configure_kernels(self._kernels_before)
            self._kernels_before = None

    def _check_serving(self) -> None:
        if self.draining:
            raise Unavailable("this worker is draining (shutting down); send the request to another worker")
        if not self.ready:
            raise Unavailable("this worker is still loading its base model; retry shortly")

    # -- requests ---------------------------------------------------------------------------------------
    def is_base(self, model_id: str) -> bool:
        return model_id in ("", self.base_name)

    async def generate(self, p: Request) -> AsyncIterator[TokenEvent]:
        """`stream`'s tokens one at a time (in-process callers); leaving the loop cancels the request."""
        async with contextlib.aclosing(self.stream(p)) as batches:
            async for ready in batches:
                for ev in ready:
                    yield ev

    async def _prompt_ids(self, p: Request, tokenizer, vocab: int) -> list[int]:
        """The prompt's tokens: its token ids as they are (each checked against the vocabulary `vocab`),
        or its text tokenized by `tokenizer` (the base's, or the variant's own)."""
        if p.prompt_token_ids:
            bad = next((t for t in p.prompt_token_ids if t >= vocab), None)
            if bad is not None:
                raise InvalidArgument(f"prompt_token_ids: {bad} is not a token of this model (0 to {vocab - 1})")
            return list(p.prompt_token_ids)
        limit = self.config.max_prompt_bytes
        if len(p.prompt) > limit or len(p.prompt.encode()) > limit:  # characters <= bytes: cheap test first
            raise InvalidArgument(
                f"the prompt has {len(p.prompt.encode())} bytes; this worker accepts at most "
                f"{limit} (--max-prompt-bytes)"
            )
        # Off the loop, through encode_batch, which releases the GIL (encode holds it throughout);
        # `.ids` builds the Python list, so that happens on the thread too.
        # A rendered chat template wrote its own BOS: the tokenizer must not add a second one.
        specials = not p.templated
        return await asyncio.to_thread(lambda: tokenizer.encode_batch([p.prompt], add_special_tokens=specials)[0].ids)

    def _grammars_of(self, entry: DeltaEntry | None) -> GrammarCompiler:
        """The grammar compiler of a request's tokenizer: the base's, or one per variant tokenizer
        (its tokenizer.json written once under the worker's own directory, as llguidance reads it)."""
        own = entry.tokenizer if entry is not None else None
        if own is None:
            return self.grammars
        eos = entry.eos_ids or self.eos_ids
        vocab = entry.vocab_size or self.args.vocab_size
        key = (own.sha256, tuple(sorted(eos)), vocab)
        if key not in self._variant_grammars:
            if self._own_dir is None:
                self._own_dir = tempfile.TemporaryDirectory(prefix="bitdelta-tokenizers-")
            path = Path(self._own_dir.name) / f"{own.sha256}.json"
            if not path.exists():
                path.write_bytes(own.json)
            self._variant_grammars[key] = GrammarCompiler(path, vocab, eos)
        return self._variant_grammars[key]

    async def stream(self, p: Request) -> AsyncIterator[list[TokenEvent]]:
        """The request's tokens as they come: each item every token ready when the consumer asks
        (one when it keeps up; at most --stream-max-tokens), in order, choices interleaved. The
        first token (choice 0's, with the TTFT) comes alone, in the first list.

        A variant's request holds its delta first (loading it if need be): its fine-tune's own
        tokenizer, when the delta carries one, reads the prompt and writes the text."""
        t_arrival = time.perf_counter()
        t_arrival_ns = first_ns = time.time_ns()  # traces: the engine's times become spans after the fact
        self._check_serving()
        p.validate()
        name = None if self.is_base(p.model_id) else p.model_id
        sp = p.sampling
        if sp.n > self.scheduler.max_running:
            raise InvalidArgument(
                f"sampling.n: {sp.n} choices; this worker runs at most {self.scheduler.max_running} sequences"
            )
        if self.engine.waiting >= self.config.max_waiting:
            raise ResourceExhausted(f"{self.engine.waiting} requests are already waiting on this worker; retry later")
        queue: asyncio.Queue = asyncio.Queue()
        held, submitted, finished = 0, False, False  # held: slot references (one per choice)
        states: list[SeqState] = []
        try:
            slot, load_ms, arrival, entry = -1, 0.0, ArrivalState.BASE, None
            if name is not None:
                arrival = {DeltaState.RESIDENT: ArrivalState.RESIDENT, DeltaState.LOADING: ArrivalState.LOADING}.get(
                    self.manager.state_of(name), ArrivalState.COLD
                )
                t = time.perf_counter()
                with _load_span(name, arrival) as span:  # the store's Fetch joins this trace (cold loads)
                    slot = await self.manager.acquire(name)
                    held = 1
                    entry = self.manager.entries[name]  # resident and held: its bytes are these
                    span.set_attribute("delta.bytes", entry.bytes)
                load_ms = (time.perf_counter() - t) * 1e3
            tokenizer = (
                entry.tokenizer.tokenizer if entry is not None and entry.tokenizer is not None else self.tokenizer
            )
            vocab = (entry.vocab_size if entry is not None else 0) or self.args.vocab_size  # a grown one: the variant's
            p.sampling.check_vocab(vocab)
            ids = await self._prompt_ids(p, tokenizer, vocab)
            if sp.truncate_prompt_tokens is not None:  # the caller's own left truncation (vLLM's)
                keep = sp.truncate_prompt_tokens
                if keep == -1:  # as many as the context leaves for max_new_tokens
                    keep = max(1, self.args.max_seq_len - max(1, sp.max_new_tokens))
                ids = ids[-keep:]
            if not ids:
                if self.args.bos_token_id is None:
                    raise InvalidArgument("the prompt is empty and the model has no BOS token to start from")
                ids = [self.args.bos_token_id]
            if self.config.max_prompt_tokens and len(ids) > self.config.max_prompt_tokens:
                raise InvalidArgument(
                    f"the prompt has {len(ids)} tokens; this worker accepts at most "
                    f"{self.config.max_prompt_tokens} (--max-prompt-tokens)"
                )
            room = self.args.max_seq_len - len(ids)
            if room <= 0:
                raise InvalidArgument(
                    f"the prompt has {len(ids)} tokens; the model's context is {self.args.max_seq_len}"
                )
            if sp.max_new_tokens > room:  # asked for explicitly: refused, never silently cut short
                raise InvalidArgument(
                    f"sampling.max_new_tokens: {sp.max_new_tokens} is more than the context leaves after the "
                    f"prompt's {len(ids)} tokens ({room} of {self.args.max_seq_len})"
                )
            max_new = min(sp.max_new_tokens or sp.default_max_new_tokens or self.config.default_max_new_tokens, room)
            if not sp.max_new_tokens:  # a default, not an ask: also cut to what the KV pool can ever hold for it
                s = self.scheduler
                held_blocks = (s.allocator.n_blocks - (sp.n - 1) * s.fork_copies(len(ids))) * s.block_size - len(ids)
                max_new = min(max_new, max(held_blocks, 1))  # < 1: the prompt alone is too large, refused below
            states = [SeqState(next(self._ids), ids, max_new, -1, priority=p.priority) for _ in range(sp.n)]
            states[0].forks = sp.n - 1
            if self.scheduler.blocks_needed(states[0]) > self.scheduler.allocator.n_blocks:
                # no amount of waiting makes it fit: INVALID_ARGUMENT, not RESOURCE_EXHAUSTED (retried forever)
                raise InvalidArgument(
                    f"sampling.max_new_tokens: the prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) "
                    f"x {sp.n} choices is more than this worker's whole KV cache "
                    f"({self.scheduler.capacity_tokens()} tokens); shorten them"
                )
            # compiled on the compiler's threads (cached); a constraint that does not compile: INVALID_ARGUMENT
            grammar = None if sp.constraint is None else await self._grammars_of(entry).compile(sp.constraint)
            bad = await asyncio.to_thread(bad_word_ids, tokenizer, sp.bad_words) if sp.bad_words else ()
            while name is not None and held < sp.n:  # resident now: every choice holds the slot until it leaves
                await self.manager.acquire(name)
                held += 1
            weights = self.base_fingerprint if name is None else f"{self.base_fingerprint}/{entry.content}"
            # a fine-tune that ends on its own tokens (its delta's) ends there, as it would served alone
            eos_ids = entry.eos_ids if name is not None and entry.eos_ids else self.eos_ids
            root = cache_root(weights, p.cache_salt)
            seqs = []
            for i, st in enumerate(states):
                st.slot = slot
                st.cache_root, st.reuse = root, sp.prompt_logprobs is None  # echo needs every prompt row
                choice = dataclasses.replace(sp, seed=sp.choice_seed(i))
                seqs.append(
                    Sequence(
                        state=st,
                        sampler=Sampler(
                            choice,
                            ids,
                            vocab,
                            eos_ids,
                            None if grammar is None else grammar.start(),
                            bad,
                        ),
                        text=TextStream(
                            tokenizer, ids, list(sp.stop), sp.include_stop_str_in_output, sp.skip_special_tokens
                        ),
                        eos_ids=eos_ids,
                        emit=queue.put_nowait,
                        delta_name=name,
                        arrival=arrival,
                        t_arrival=t_arrival,
                        delta_load_ms=load_ms,
                        deadline=p.deadline,
                        sent_first=i > 0,  # the first token of choice 0 carries the request's TTFT
                        index=i,
                    )
                )
            seqs[0].forks = seqs[1:]
            self.engine.submit(seqs[0])
            submitted = True
            open_choices, limit = sp.n, self.config.stream_max_tokens
            while True:
                ready, error = [], None
                for ev in await take_ready(queue, limit):
                    if isinstance(ev, BaseException):  # the other choices are cancelled below
                        error = ev
                        break
                    if ev.ttft is not None:
                        first_ns = _trace_first_token(ev, t_arrival_ns, name, len(ids))
                    if ev.finish_reason is not None:
                        open_choices -= 1
                        if ev.index == 0 and ev.usage.completion_tokens:
                            _trace_decode(ev, t_arrival_ns, first_ns)
                    ready.append(ev)
                finished = open_choices == 0
                if ready:  # the first token goes alone, at once: the TTFT is the client's too
                    for message in first_alone(ready, first=ready[0].ttft is not None):
                        yield message
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            if submitted and not finished:
                for st in states:  # each leaves the batch at the next step; the engine releases its slot
                    self.engine.cancel(st.seq_id)
            elif not submitted:
                for _ in range(held):
                    self.manager.release(name)

    async def load_delta(self, name: str, pin: bool = False) -> tuple[SlotInfo, float]:
        self._check_serving()
        if self.is_base(name):
            raise InvalidArgument(f"{name!r} is the base model, which is always resident")
        check_model_id(name, "name")
        t = time.perf_counter()
        was_resident = self.manager.state_of(name) == DeltaState.RESIDENT
        await self.manager.load(name, pin=pin)
        waited = 0.0 if was_resident else (time.perf_counter() - t) * 1e3
        return self.slot_info(name), waited

    async def evict_delta(self, name: str) -> DeltaState:
        if not self.ready:
            raise Unavailable("this worker is still loading its base model; retry shortly")
        if self.is_base(name):
            raise InvalidArgument(f"{name!r} is the base model, which is always resident and cannot be evicted")
        check_model_id(name, "name")
        return await self.manager.evict(name)

    def slot_info(self, name: str) -> SlotInfo:
        for s in self.manager.snapshot():
            if s.name == name:
                return s
        return SlotInfo(name, DeltaState.ABSENT, 0, False, 0.0, "", "")

    def status(self) -> WorkerStatus:
        if not self.ready:
            return WorkerStatus(
                self.base_name,
                self.base_fingerprint,
                self.device.type,
                [],
                self.config.delta_budget,
                0,
                0,
                0,
                0,
                0,
                tensor_parallel=self.config.tensor_parallel,
            )
        return WorkerStatus(
            self.base_name,
            self.base_fingerprint,
            self.device.type,
            self.manager.snapshot(),
            self.manager.budget_bytes,
            self.manager.used_bytes,
            self.engine.running,
            self.engine.waiting,
            self.scheduler.used_tokens(),
            self.scheduler.capacity_tokens(),
            self.scheduler.preemptions,
            self.scheduler.prefix_queries,
            self.scheduler.prefix_hits,
            tensor_parallel=self.config.tensor_parallel,
            ranks=tuple(self.tp.rank_memory(self.manager.resident_bytes)) if self.tp is not None else (),
        )


def _load_span(name: str, arrival: ArrivalState):
    """A live span around waiting for a delta that is not resident (nothing for a resident one)."""
    if arrival is ArrivalState.RESIDENT:
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return telemetry.tracer().start_as_current_span(
        "worker.load_delta",
        attributes={
            "delta.name": name,
            "arrival_state": arrival.value,
            "delta.load_joined": arrival is ArrivalState.LOADING,
        },
    )


def _trace_first_token(ev: TokenEvent, t0_ns: int, name: str | None, prompt_tokens: int) -> int:
    """schedule wait and prefill as spans, from the engine's times (TokenEvent.ttft, ms since arrival)."""
    span = trace.get_current_span()
    t = ev.ttft
    first = t0_ns + int(t.total_ms * 1e6)
    prefill = first - int(t.prefill_ms * 1e6)
    sched = prefill - int(t.schedule_ms * 1e6)
    span.set_attributes(
        {
            "model_id": name or "",
            "arrival_state": ev.arrival.value,
            "prompt_tokens": prompt_tokens,
            "prefill.batch_size": ev.prefill_batch,
            "ttft.delta_load_ms": t.delta_load_ms,
            "ttft.schedule_ms": t.schedule_ms,
            "ttft.prefill_ms": t.prefill_ms,
            "ttft.total_ms": t.total_ms,
        }
    )
    telemetry.record_span("worker.schedule", sched, prefill)
    telemetry.record_span(
        "worker.prefill", prefill, first, {"batch_size": ev.prefill_batch, "prompt_tokens": prompt_tokens}
    )
    span.add_event("first_token", timestamp=first)
    return first


def _trace_decode(ev: TokenEvent, t0_ns: int, first_ns: int) -> None:
    """One span from the first token to the last, with the token count (not a span per token)."""
    span = trace.get_current_span()
    n = ev.usage.completion_tokens
    span.set_attributes({"completion_tokens": n, "finish_reason": ev.finish_reason.value})
    telemetry.record_span("worker.decode", first_ns, t0_ns + int(ev.elapsed_ms * 1e6), {"completion_tokens": n})
