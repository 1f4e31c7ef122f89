"""Device memory addressed by the scheduler's slot ids: the KV pool and the auxiliary-state
pool of recurrent layers. How one forward addresses them is ``paths/pool_cache.py``."""
