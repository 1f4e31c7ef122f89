"""How a forward pass reads and writes K/V, per device: one chooser, one folder per path.

``attention_paths.AttentionPaths`` decides once, at load, from the layer description
(``model/discovery.CacheLayout``) and the device:

| device | full or sliding-window attention (sinks too), one K/V width | latent or by-hand attention | prefill |
|---|---|---|---|
| CUDA GPU | ``cuda/``: the paged kernel reads pool slots (a windowed layer its last W through ``window_view``), new K/V wait in a decode tail; every row count's step compiled (``compiled_paged``), one trace per row class and launch shape | ``rows/`` row cache where it fits, else a pool gather (``paged_attention`` without kernel) | padded to recurring shapes (``prefill_shapes``), common ones run at start-up (``prefill_warmup``) |
| CPU | ``rows/``: dense per-row K/V, the compiled decode step (``compiled_decode``), attention split over CPU streams (``parallel_attention``) | ``rows/`` as well | unpadded |
| Metal | ``rows/``, eager (the compiled step is not yet checked there) | ``rows/`` | padded as on CUDA |

Hybrid models' recurrent layers take whichever path their attention layers take; a steady
decode batch's states are that path's step inputs and outputs, in batch order, and reach the
aux pool only when the batch changes (``pools/aux_pool.AuxPool.keep``).

Files here are shared by every path: the decode plan (row buckets, lengths), prefill
grouping and shapes, steps whose K/V reach the pool later (``deferred_steps``) and the
compiled-trace cache.
"""
