"""``python -m runtime.bench ...``: same as ``runtime bench ...``."""

from __future__ import annotations

import sys

from runtime.bench.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
