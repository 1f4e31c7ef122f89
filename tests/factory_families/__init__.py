"""More mlx-lm families for the model factory, one module per group.

Each module exports ``CONFIGS`` (model type -> a function returning its tiny config) and may
export ``QK_WEIGHTS``, ``QK_NORMS`` and ``FINAL_NORMS`` (weight-name suffixes the factory's
init treats as query/key projections, q/k norm scales and the final norm) and ``NESTED`` (types
whose config nests the language model under ``text_config``) and ``REFUSED`` (model type -> a
pattern the runtime's refusal at load must match: served nowhere, refused clearly).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Callable

CONFIGS: dict[str, Callable[[], dict]] = {}
QK_WEIGHTS: tuple[str, ...] = ()
QK_NORMS: tuple[str, ...] = ()
FINAL_NORMS: tuple[str, ...] = ()
NESTED: set[str] = set()
REFUSED: dict[str, str] = {}

# FACTORY_FAMILIES=a,b limits the import to those modules (while one is being written).
_ONLY = set(filter(None, os.environ.get("FACTORY_FAMILIES", "").split(",")))

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _ONLY and _info.name not in _ONLY:
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    _clash = set(CONFIGS) & set(_module.CONFIGS)
    assert not _clash, f"{_info.name} defines {_clash} again"
    CONFIGS.update(_module.CONFIGS)
    QK_WEIGHTS += tuple(getattr(_module, "QK_WEIGHTS", ()))
    QK_NORMS += tuple(getattr(_module, "QK_NORMS", ()))
    FINAL_NORMS += tuple(getattr(_module, "FINAL_NORMS", ()))
    NESTED |= set(getattr(_module, "NESTED", ()))
    REFUSED.update(getattr(_module, "REFUSED", {}))
