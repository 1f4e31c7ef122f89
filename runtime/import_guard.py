"""Keep PyTorch out of the service's processes.

mlx-lm imports ``transformers`` (for tokenizers) wherever any of it is imported, and
``transformers`` imports PyTorch whenever it is installed. The service never uses it, yet on
a GPU host with PyTorch installed it cost the worker 9 of its 12 s of imports (H200, session
19, ``python3 -X importtime``) and the scheduler as much before its tokenizer loaded.
"""

from __future__ import annotations

import os
import sys


def keep_torch_out() -> bool:
    """Make ``torch`` look absent to this process from now on (``None`` in ``sys.modules``:
    ``importlib.util.find_spec`` answers None and ``import torch`` raises ImportError), unless
    it is imported already. True if it is kept out. Also silences transformers' advice that
    PyTorch was not found (its only effect here is that line in the service's log)."""
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return True
