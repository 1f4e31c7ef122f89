"""Device memory addressed by the scheduler's slot ids: the KV pool, the auxiliary-state pool
of recurrent layers, and the per-layer cache objects that let mlx-lm's model code read and
write them."""
