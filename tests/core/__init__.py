"""The core library (bitdelta/): model, checkpoints, the delta format, compression, distillation, the CLI, the planner, the precision rule."""
