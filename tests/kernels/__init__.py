"""The kernels (bitdelta_kernels/): Triton and C paths against the reference, numerics, launch configurations."""
