"""An LLM serving runtime on Apple's MLX: a scheduler process and an MLX worker over ZeroMQ."""

__version__ = "0.1.0"
