"""The kernels (kernels/): Triton and C paths against the reference, numerics, launch configurations."""
