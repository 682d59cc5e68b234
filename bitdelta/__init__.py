"""bitdelta: the core library shared by the services and the offline toolkit.

Modules: `format` (delta file v1), `model` (compact Llama), `checkpoint` (Hugging Face layout I/O and base fingerprint),
`compress` (signs, scales, apply), `distill` (scale distillation), `cli`.
The sign packing is `kernels.bits` (the kernels are the layer below the core).
Generated protobuf modules live in `bitdelta.<service>.v1` (see protos_build).
"""

__version__ = "0.1.0"
