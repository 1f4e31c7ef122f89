"""CUDA only: the paged attention kernel (``mx.fast.cuda_kernel``), the decode tail it
appends to, the compiled one-row decode step, and MLX's CUDA graph limits."""
