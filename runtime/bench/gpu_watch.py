"""The peak device memory of the bench's processes over a phase, sampled from ``nvidia-smi``.

On CUDA a process's RSS does not include what it holds on the GPU, and a server that runs out of
device memory mid-phase (``cudaMallocAsync ... out of memory``) leaves no trace of who held it:
the samples say whether it was the server itself or something left over from an earlier phase.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from runtime.bench.service import gpu_memory_bytes


class GpuWatch:
    """Samples every process's device memory every ``period_s`` in a thread while in a ``with``
    block; ``peaks`` maps a pid to the most it held. Samples nothing where ``nvidia-smi`` is absent."""

    def __init__(self, period_s: float = 2.0, sample: Callable[[], dict[int, int] | None] = gpu_memory_bytes) -> None:
        self.period_s, self.sample = period_s, sample
        self.peaks: dict[int, int] = {}
        self.peak_total = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _take(self) -> bool:
        now = self.sample()
        if now is None:
            return False
        self.samples += 1
        for pid, used in now.items():
            self.peaks[pid] = max(self.peaks.get(pid, 0), used)
        self.peak_total = max(self.peak_total, sum(now.values()))
        return True

    def _run(self) -> None:
        while self._take() and not self._stop.wait(self.period_s):
            pass

    def __enter__(self) -> GpuWatch:
        self._thread = threading.Thread(target=self._run, name="gpu-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15.0)

    def summary(self, names: dict[str, int | None]) -> str:
        """One line: the named processes' peaks, then the rest's, in GiB ('' without samples)."""
        if not self.samples:
            return ""
        named = {pid for pid in names.values() if pid}
        parts = [f"{name} {self.peaks.get(pid, 0) / 2**30:.1f} GiB" for name, pid in names.items() if pid]
        others = {pid: used for pid, used in self.peaks.items() if pid not in named and used}
        if others:
            parts.append("others " + ", ".join(f"pid {pid} {used / 2**30:.1f} GiB" for pid, used in others.items()))
        return (f"peak GPU memory over {self.samples} samples: " + ", ".join(parts)
                + f" (all processes together at most {self.peak_total / 2**30:.1f} GiB)")
