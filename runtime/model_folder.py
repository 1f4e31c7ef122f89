"""Facts about a model folder that need no model loaded (the scheduler reads them; it never imports mlx)."""

from __future__ import annotations

import json
from pathlib import Path


def model_type_of(folder: str) -> str:
    """The folder's ``model_type`` from its config.json ("" where it cannot be read)."""
    try:
        return str(json.loads((Path(folder) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""
