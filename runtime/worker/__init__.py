"""The MLX worker process: owns the model, the KV pool and every MLX array."""
