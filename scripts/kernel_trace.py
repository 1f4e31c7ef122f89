"""Per-kernel GPU time of a code region, read with PyTorch's CUPTI profiler (CUDA only).

MLX's CUDA backend launches plain CUDA kernels (most inside CUDA graphs), so the CUDA activity
tracing of ``torch.profiler`` sees them too. Nsight Systems is not installed on the lent GPU
machines; this is what ``scripts/profile_decode.py --kernels`` uses instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterator


@contextlib.contextmanager
def traced(report: dict) -> Iterator[None]:
    """Trace CUDA kernels while the block runs; fill ``report`` with their records afterwards."""
    import torch.profiler as tp

    prof = tp.profile(activities=[tp.ProfilerActivity.CUDA])
    prof.start()
    try:
        yield
    finally:
        prof.stop()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        report["kernels"] = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
                             if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def summary(report: dict, steps: int, top: int = 14) -> str:
    """Per step: kernel count, summed kernel time, busy time (overlaps merged), span, and the
    kernels that take the most time."""
    kernels = sorted(report.get("kernels", []), key=lambda k: k[1])
    if not kernels:
        return "  no kernels traced"
    busy = 0.0
    end = -1.0
    for _, ts, dur in kernels:
        start = max(ts, end)
        if ts + dur > start:
            busy += ts + dur - start
        end = max(end, ts + dur)
    span = kernels[-1][1] + kernels[-1][2] - kernels[0][1]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, _, dur in kernels:
        by_name[name][0] += 1
        by_name[name][1] += dur
    total = sum(d for _, _, d in kernels)
    lines = [f"  per step: {len(kernels) / steps:.0f} kernels, kernel time {total / steps / 1e3:.3f} ms, "
             f"busy {busy / steps / 1e3:.3f} ms, span {span / steps / 1e3:.3f} ms "
             f"(idle {100 * (1 - busy / span):.1f}%)"]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    for name, (count, dur) in ranked[:top]:
        lines.append(f"    {dur / steps:8.1f} us/step {count / steps:6.1f}x  {name[:110]}")
    copies = [(name, cd) for name, cd in ranked[top:] if "copy" in name]  # copies compared side to side
    if copies:
        lines.append("    copies past those:")
        lines += [f"    {dur / steps:8.1f} us/step {count / steps:6.1f}x  {name[:110]}" for name, (count, dur) in copies]
    return "\n".join(lines)
