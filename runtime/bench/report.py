"""The run header, markdown tables and the JSON dump."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def header() -> dict[str, Any]:
    """Machine, library versions, date and the exact command line of this run."""
    import mlx.core as mx

    info: dict[str, Any] = {}
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception:  # not every backend reports device info
        pass
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": os.environ.get("RUNTIME_BENCH_COMMAND") or " ".join(getattr(sys, "orig_argv", sys.argv)),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "cwd": os.getcwd(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx_device": str(mx.default_device()),
        "mlx_device_info": info,
        "mlx": getattr(mx, "__version__", _version("mlx")),
        "mlx_lm": _version("mlx-lm"),
        "runtime": _version("mlx-serving-runtime"),
        "loadavg_start": loadavg(),
        "runtime_source_sha256": source_fingerprint(),
    }


def source_fingerprint() -> str:
    """sha256 over the runtime's own sources (runtime/**/*.py, bench excluded), first 16 hex digits.

    The tree may be edited between runs; this tells which code a set of numbers belongs to.
    """
    import hashlib

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "bench":
            continue
        digest.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def format_header(h: dict[str, Any]) -> str:
    """Header lines for the human-readable report."""
    lines = [
        f"date:     {h['date']}",
        f"command:  {h['command']}",
        f"machine:  {h['platform']} ({h['machine']}), {h['cpu_count']} CPUs",
        f"device:   {h['mlx_device']} {h['mlx_device_info'] or ''}".rstrip(),
        f"blas:     {('LD_PRELOAD=' + h['ld_preload']) if h['ld_preload'] else 'as bundled with mlx'} "
        "(bench process and runtime worker alike)",
        f"versions: python {h['python']}, mlx {h['mlx']}, mlx-lm {h['mlx_lm']}, runtime {h['runtime']} "
        f"(sources sha256 {h['runtime_source_sha256']})",
        f"load:     {h['loadavg_start']} (1/5/15-min load average at start)",
    ]
    return "\n".join(lines)


def fmt(value: Any, digits: int = 1) -> str:
    """Numbers for tables: nan as '-', ratios and small values with more digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) < 10 and digits < 2:
            return f"{value:.2f}"
        return f"{value:.{digits}f}"
    return str(value)


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (aligned, so it also reads well in a terminal)."""
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" if i else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    out = [f"### {title}", "", line(cells[0]), sep] + [line(r) for r in cells[1:]]
    return "\n".join(out)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """All numbers of the run (nan written as null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(data), indent=2) + "\n")
