"""A model's cache entries, flattened: a layer whose cache is a ``CacheList`` owns several.

Falcon-H1 gives every layer ``CacheList(ArraysCache, KVCache)``: a Mamba state and a KV cache
the layer's two mixers index as ``cache[0]`` and ``cache[1]``. The worker's pools work on flat
entries (each a KV cache or an auxiliary state), so the layout flattens the model's list once
at load, and every forward nests its flat cache objects back into the model's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import CacheList


class NestedCacheError(ValueError):
    """A cache list this runtime cannot flatten; the message says why."""


@dataclass(frozen=True)
class EntryGroups:
    """``sizes[e]``: how many flat entries model cache entry ``e`` has when it is a
    ``CacheList`` (its parts, in order), or 0 for a plain cache (one flat entry)."""

    sizes: tuple[int, ...] = ()

    @classmethod
    def of(cls, caches: list) -> EntryGroups:
        """The groups of a fresh ``make_cache()`` list; refuses lists inside lists."""
        sizes = []
        for e, cache in enumerate(caches):
            if not isinstance(cache, CacheList):
                sizes.append(0)
                continue
            parts = list(cache.caches)
            if not parts or any(isinstance(p, CacheList) for p in parts):
                raise NestedCacheError(f"cache entry {e} is a CacheList that is empty or holds another CacheList")
            sizes.append(len(parts))
        return cls(tuple(sizes))

    @property
    def nested(self) -> bool:
        """Some model cache entry is a CacheList."""
        return any(self.sizes)

    def flatten(self, caches: list) -> list:
        """The flat entries of the model's cache list ``caches``."""
        if not self.nested:
            return list(caches)
        flat: list = []
        for size, cache in zip(self.sizes, caches):
            flat.extend(cache.caches if size else [cache])
        return flat

    def nest(self, flat: list) -> list:
        """The model's cache list from flat cache objects (a CacheList of each group's parts)."""
        if not self.nested:
            return flat
        out: list = []
        at = 0
        for size in self.sizes:
            if size:
                out.append(CacheList(*flat[at : at + size]))
                at += size
            else:
                out.append(flat[at])
                at += 1
        assert at == len(flat), "one cache object per flat entry"
        return out

    def owners(self, count: int) -> list[int]:
        """The model cache entry of each of ``count`` flat entries."""
        if not self.nested:
            return list(range(count))
        return [e for e, size in enumerate(self.sizes) for _ in range(max(size, 1))]
