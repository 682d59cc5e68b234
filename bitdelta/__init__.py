"""bitdelta: the core library shared by the services and the offline toolkit.

Modules: `format` (delta file v1), `model` (compact Llama), `checkpoint` (Hugging Face layout I/O and base fingerprint),
`compress` (signs, scales, apply), `distill` (scale distillation), `cli`.
The sign packing is `bitdelta_kernels.bits` (the kernels are the layer below the core).
Generated protobuf modules live in `bitdelta.<service>.v1` (see protos_build).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`bitdelta.LLM`: the offline Python API on the worker's engine (services/gpu_worker/offline.py),
    imported on first use so that importing the core never loads a service. The one place the core
    names a service (tests/test_architecture.py allows exactly this one)."""
    if name == "LLM":
        from services.gpu_worker.offline import LLM

        return LLM
    raise AttributeError(f"module 'bitdelta' has no attribute {name!r}")
