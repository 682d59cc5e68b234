"""bitdelta: the core library shared by the services and the offline toolkit.

Modules: `bits` (sign packing), `format` (delta file v1), `model` (compact
Llama), `checkpoint` (Hugging Face layout I/O and base fingerprint),
`compress` (signs, scales, apply), `distill` (scale distillation), `cli`.
Generated protobuf modules live in `bitdelta.<service>.v1` (see protos_build).
"""

__version__ = "0.1.0"
