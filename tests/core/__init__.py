"""The core library (bitdelta/): bits, model, checkpoints, the delta format, compression, distillation, the CLI, the planner, the precision rule."""
