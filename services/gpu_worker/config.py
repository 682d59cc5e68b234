"""The worker's one typed configuration (flags + `BITDELTA_WORKER_*` variables).

Parsed by the shared `bitdelta.rpc.config.ServiceConfig`: every field `foo_bar`
is the flag `--foo-bar` and the variable `BITDELTA_WORKER_FOO_BAR`; a flag wins
over the environment. Values are checked when the config is built (also in
tests that build it directly), with errors that say what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from bitdelta.rpc.config import ConfigError, ProcessSettings, ServiceConfig, check_address, setting
from bitdelta.rpc.security import AuthSettings, TlsSettings
from bitdelta.units import parse_bytes
from bitdelta_kernels.settings import BACKENDS

ENV_PREFIX = "BITDELTA_WORKER_"


@dataclass(frozen=True)
class WorkerConfig(ServiceConfig, ProcessSettings, TlsSettings, AuthSettings):
    """BitDelta GPU worker: one base, many variants, one batch."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX
    PROG: ClassVar[str] = "python -m services.gpu_worker"

    base: Path = setting(help="checkpoint directory of the base model (config.json, weights, tokenizer.json)")
    address: str = setting("[::]:50061", "HOST:PORT to listen on", check=check_address)
    base_name: str = setting("", "model id of the base; empty: the checkpoint's _name_or_path or directory name")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting("auto", "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16")
    delta_store: str = setting("", "HOST:PORT of the delta_store service")
    delta_dir: str = setting("", "or: a local directory of delta files (development, tests)")
    delta_budget: int = setting(1 << 30, "device bytes for deltas, e.g. 4GiB", parse=parse_bytes)
    max_slots: int = setting(0, "delta slots; 0: budget // slot bytes (the byte budget then binds first)")
    pin_hottest: int = setting(0, "the N deltas with the highest request rate are never evicted")
    rate_half_life_s: float = setting(60.0, "half-life of the request-rate weighting, seconds")
    kv_cache: int = setting(256 << 20, "device bytes for the KV cache", parse=parse_bytes)
    block_size: int = setting(16, "tokens per KV block")
    prefix_caching: bool = setting(
        True,
        "reuse the KV blocks of a cached prefix (same weights, same tokens, same cache salt); "
        "off for a length-dependent rope (dynamic, LongRoPE)",
    )
    max_running: int = setting(64, "sequences per batch")
    max_batch_tokens: int = setting(2048, "tokens per step (prefill chunks + decodes)")
    max_waiting: int = setting(1024, "queued sequences beyond which Generate is RESOURCE_EXHAUSTED")
    stream_max_tokens: int = setting(
        0,
        "most tokens in one Generate stream message; 0: every token ready when the message is written "
        "(1: one message per token, the wire's old behaviour, for comparison)",
    )
    default_max_new_tokens: int = setting(256, "max_new_tokens when a request leaves it 0")
    max_prompt_bytes: int = setting(1 << 20, "longer prompts are INVALID_ARGUMENT before tokenising", parse=parse_bytes)
    max_prompt_tokens: int = setting(0, "longer prompts are INVALID_ARGUMENT; 0: the model's context")
    fused_single_variant: bool = setting(True, "a batch of one variant uses the fused kernel")
    decode_burst_ms: float = setting(
        100.0,
        "CPU: a batch of decodes of plain greedy sequences (no logprobs), with nobody waiting, runs as many "
        "steps as fit in this many ms (by the last step's time) in one C call, each token fed back in C: "
        "streams get tokens a burst at a time, and a request or a cancel that arrives ends a burst after its "
        "current step (docs/worker.md, 'Decode bursts'); 0: one step a call",
    )
    kernel_backend: str = setting(
        "",
        "auto | triton | cpu | torch: the kernels every layer runs (auto: Triton on CUDA, the C kernels on CPU); "
        "empty: the process's kernel settings (BITDELTA_KERNEL_BACKEND, else auto)",
    )
    batch_invariant: bool = setting(
        False,
        "a request's tokens never depend on what else its steps hold (bit-identical numbers per row, "
        "as vLLM's VLLM_BATCH_INVARIANT): the CPU kernels' per-row paths at every batch size, slower "
        "prefill (docs/kernels.md, 'Batch invariance'); CPU only; also BITDELTA_BATCH_INVARIANT=1",
    )
    cuda_graphs: bool = setting(
        False,
        "CUDA only: replay each decode step's layers as a CUDA graph per batch bucket (1, 2, 4 ... "
        "max_running), captured at start-up (a shape of more sign planes per row: on first use), instead "
        "of launching every op from Python (docs/worker.md, 'CUDA graphs'); not with --tensor-parallel",
    )
    allow_slow_kernels: bool = setting(
        False,
        "on CUDA without Triton, serve with the torch reference kernels (~10x slower) instead of refusing to start",
    )
    store_timeout_s: float = setting(600.0, "deadline of one Fetch from the delta store, seconds")
    store_shared_memory: bool = setting(
        True,
        "copy deltas out of the store's shared host cache when it offers one "
        "(same host, store run with --shared-memory-dir) instead of streaming them",
    )

    tensor_parallel: int = setting(
        1,
        "ranks (one process per device) that hold one worker's base and deltas split Megatron-style; "
        "the worker starts the other ranks itself, or runs under torchrun (docs/tensor-parallel.md)",
    )
    tp_timeout_s: float = setting(
        30.0, "deadline of every collective between the ranks, seconds: a dead or hung rank stops the worker"
    )
    tp_start_timeout_s: float = setting(
        600.0,
        "how long rank 0 waits for the other ranks to start and load their shards of the base, seconds "
        "(a spawned rank that exits first fails the start at once)",
    )

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        self.check_process()
        self.check_tls()
        self.tokens()  # a tokens file that cannot be used fails at start, naming the flag
        base = Path(self.base)
        if not (base / "config.json").is_file():
            raise ConfigError(f"--base {base}: not a checkpoint directory (no config.json)")
        if not (base / "tokenizer.json").is_file():
            raise ConfigError(f"--base {base}: no tokenizer.json beside the weights")
        if self.delta_store and self.delta_dir:
            raise ConfigError("give --delta-store or --delta-dir, not both")
        if self.delta_store:
            try:
                check_address(self.delta_store)
            except ValueError as e:
                raise ConfigError(f"--delta-store {self.delta_store!r}: {e}") from None
        if self.delta_dir and not Path(self.delta_dir).is_dir():
            raise ConfigError(f"--delta-dir {self.delta_dir}: not a directory")
        if self.kernel_backend and self.kernel_backend not in BACKENDS:
            raise ConfigError(
                f"--kernel-backend {self.kernel_backend!r}: use {', '.join(BACKENDS)} (or leave it empty)"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype {self.dtype!r}: use auto, float32, bfloat16 or float16")
        for name in (
            "delta_budget",
            "kv_cache",
            "block_size",
            "max_running",
            "max_batch_tokens",
            "default_max_new_tokens",
            "max_waiting",
        ):
            if getattr(self, name) < (0 if name == "delta_budget" else 1):
                raise ConfigError(f"{self.flag_of(name)} must be positive, got {getattr(self, name)}")
        if self.tensor_parallel < 1:
            raise ConfigError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.tp_timeout_s <= 0 or self.tp_start_timeout_s <= 0:
            raise ConfigError(
                f"--tp-timeout-s and --tp-start-timeout-s must be positive, got {self.tp_timeout_s} and "
                f"{self.tp_start_timeout_s}"
            )
        if not (0 <= self.decode_burst_ms <= 10_000):
            raise ConfigError(f"--decode-burst-ms must be in [0, 10000], got {self.decode_burst_ms}")
        if self.max_slots < 0 or self.pin_hottest < 0 or self.stream_max_tokens < 0:
            raise ConfigError("--max-slots, --pin-hottest and --stream-max-tokens must be >= 0")
