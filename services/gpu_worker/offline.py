"""The offline Python API for batch work: the worker's engine without a server (as vLLM's `LLM`).

    llm = bitdelta.LLM(base="data/base", deltas="data/deltas")
    outs = llm.generate(["def add(a, b):", "ROMEO."], model="coder", sampling=Sampling(max_new_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

It is the same `Worker` a `python -m services.gpu_worker` process runs (base resident once, delta
slots, continuous batching of mixed variants), started on an event loop of its own in a background
thread, so it works from plain scripts and from notebooks that already run a loop. The prompts of one
`generate` call are submitted at once and batched by the engine; a list of models gives each prompt
its own variant (one mixed batch). Deltas come from a local directory (`deltas=`) or a delta store
(`delta_store="HOST:PORT"`); every other `WorkerConfig` field can be passed by name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from bitdelta.generation import FinishReason, Logprobs, Request, Sampling, Usage
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.worker import Worker


@dataclasses.dataclass(frozen=True)
class Completion:
    """One choice of one prompt: what `Worker.generate`'s events add up to."""

    prompt: str
    model: str  # the variant, or "" for the base
    index: int  # the choice (Sampling.n > 1)
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    usage: Usage | None
    logprobs: tuple[Logprobs, ...] = ()  # with Sampling.logprobs: one per token


class LLM:
    """The engine in-process: `generate(prompts, model=..., sampling=...)` -> [Completion]."""

    def __init__(
        self,
        base: str | Path,
        deltas: str | Path | None = None,
        *,
        delta_store: str = "",
        **config,
    ):
        cfg = WorkerConfig(base=Path(base), delta_dir=str(deltas or ""), delta_store=delta_store, **config)
        cfg.check()
        self.config = cfg
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bitdelta-llm", daemon=True)
        self._thread.start()
        self.worker = Worker(cfg)
        try:
            self._run(self.worker.start())
        except BaseException:
            self.close()
            raise

    # -- the one call ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str],
        model: str | Sequence[str] = "",
        sampling: Sampling | None = None,
    ) -> list[Completion]:
        """Every prompt's completions, in prompt order (and choice order within a prompt). `model`
        names one variant for all prompts ("" or the base's name: the base) or one per prompt."""
        one = [prompts] if isinstance(prompts, str) else list(prompts)
        models = [model] * len(one) if isinstance(model, str) else list(model)
        if len(models) != len(one):
            raise ValueError(f"{len(models)} models for {len(one)} prompts: give one model, or one per prompt")
        sampling = sampling if sampling is not None else Sampling()
        sampling.validate()
        requests = [Request(model_id=m, prompt=p, sampling=sampling) for p, m in zip(one, models)]
        per_prompt = self._run(self._all(requests))
        return [c for cs in per_prompt for c in cs]

    async def _all(self, requests: list[Request]) -> list[list[Completion]]:
        return await asyncio.gather(*(self._one(r) for r in requests))

    async def _one(self, r: Request) -> list[Completion]:
        n = max(1, r.sampling.n)
        text, ids, logprobs = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n
        usage: list[Usage | None] = [None] * n
        async for ev in self.worker.generate(r):
            i = ev.index
            text[i].append(ev.text)
            ids[i].append(ev.token_id)
            if ev.logprobs is not None:
                logprobs[i].append(ev.logprobs)
            if ev.finish_reason is not None:
                finish[i], usage[i] = ev.finish_reason, ev.usage
                if ev.usage is not None:  # an ending without a new token (e.g. a deadline) repeats the last
                    del ids[i][ev.usage.completion_tokens :]
        return [
            Completion(
                r.prompt, r.model_id, i, "".join(text[i]), tuple(ids[i]), finish[i], usage[i], tuple(logprobs[i])
            )
            for i in range(n)
        ]

    # -- lifecycle ---------------------------------------------------------------------------------
    def _run(self, coro):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def close(self) -> None:
        """Stop the engine and the loop's thread; the LLM cannot be used afterwards."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self.worker.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
