"""What the loaded model is: which layers attend and how (a graph-only probe of each layer's
cache use), the per-layer cache description every path reads (``discovery.CacheLayout``),
nested cache entries, the routing of attention calls, and fused one-token projections."""
