"""Limits the config leaves to the service (key unset or 0), chosen from the device and model.

A user who sets nothing gets the configuration measured fastest on their device:

- **GPU** (CUDA or Metal): a decode step is cheap next to its launch cost, so steps carry
  many tokens: ``max_step_tokens`` 2048, ``prefill_chunk`` 512, and as many running rows
  as the device's memory suggests (256 from 64 GiB, 128 from 24 GiB, else 64).
  ``max_context`` is the model's own context (``max_position_embeddings``), bounded by
  what the KV pool holds.
- **CPU**: compute-bound steps; ``max_step_tokens`` 512, ``prefill_chunk`` 256, and
  ``max_context`` at most 4096. The CPU decodes from a dense copy of every running row's
  whole context (the row cache, laid out as mlx-lm's cache, which the compiled decode step
  reads), at most ``ROW_CACHE_BYTES``; without it decode gathers K/V from the pool each step,
  uncompiled. So the CPU runs 64 rows, or as many as that copy holds at this context: a Gemma
  3 of 12 KiB of K/V a token ran its first request at 1.38x ``generate_step`` with 42 rows and
  the copy, 0.90x with 64 rows and none (session 31).

The KV pool (``cache.kv_slots`` 0) is ``kv_memory_fraction`` of memory, capped by
``max_running * max_context`` and, where the device says how much is free once the weights are
loaded (CUDA), by that less a reserve for the steps' own buffers (``FREE_RESERVE``). The
scheduler lets a prompt's chunk grow to the whole step budget while no row decodes
(``Scheduler.next_step``), so a lone long prompt prefills in ``max_step_tokens`` chunks
without raising decode latency under load.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import Config

CPU_MAX_CONTEXT = 4096
GIB = 2**30
ROW_CACHE_BYTES = 2 * GIB  # the dense decode copy of every running row's context (paths/rows/row_cache.py), at most
FREE_RESERVE = 0.15  # of the device's memory, kept free of the pool: activations, the buffer cache


@dataclass(frozen=True)
class Device:
    """What the choice depends on: the device kind and its memory."""

    kind: str  # "cpu", "cuda" or "metal"
    memory_bytes: int
    free_bytes: int = 0  # free once the weights are loaded; 0: not known

    @property
    def gpu(self) -> bool:
        return self.kind != "cpu"


@dataclass(frozen=True)
class Limits:
    """The limits the worker runs with; ``auto`` names those chosen here, not by the config."""

    max_running: int
    max_step_tokens: int
    prefill_chunk: int
    max_context: int
    num_slots: int
    auto: tuple[str, ...]

    def describe(self) -> str:
        """One line for the start-up log: every limit, marked where it was chosen here."""
        def show(key: str) -> str:
            return f"{key} {getattr(self, key)}" + (" (auto)" if key in self.auto else "")

        return ", ".join(show(k) for k in ("max_running", "max_step_tokens", "prefill_chunk", "max_context",
                                            "num_slots"))


def device_rows(device: Device, context: int = 0, bytes_per_slot: int = 0) -> int:
    """Running rows for a GPU of this much memory; on a CPU 64, or as many as the row cache
    holds at ``context`` positions of ``bytes_per_slot`` (one more each: its scratch position)."""
    if not device.gpu:
        return max(1, min(64, ROW_CACHE_BYTES // max((context + 1) * bytes_per_slot, 1)))
    if device.memory_bytes >= 64 * GIB:
        return 256
    return 128 if device.memory_bytes >= 24 * GIB else 64


def choose(config: Config, device: Device, model_context: int, bytes_per_slot: int) -> Limits:
    """Every limit: the config's where it sets one, else the device's default (see module doc).

    ``model_context``: the model's ``max_position_embeddings``; ``bytes_per_slot``: one
    token's K/V over every attention layer (0 for a model without attention).
    """
    s, c = config.scheduler, config.cache
    auto: list[str] = []

    def pick(key: str, configured: int, default: int) -> int:
        if configured:
            return configured
        auto.append(key)
        return default

    wanted_context = s.max_context or (model_context if device.gpu else min(model_context, CPU_MAX_CONTEXT))
    max_running = pick("max_running", s.max_running, device_rows(device, wanted_context, bytes_per_slot))
    max_step_tokens = pick("max_step_tokens", s.max_step_tokens, 2048 if device.gpu else 512)
    prefill_chunk = pick("prefill_chunk", s.prefill_chunk, 512 if device.gpu else 256)
    num_slots = c.kv_slots
    if not num_slots:
        auto.append("num_slots")
        pool_bytes = int(device.memory_bytes * c.kv_memory_fraction)
        if device.free_bytes:  # another process (or our own weights) may hold much of the device
            pool_bytes = min(pool_bytes, max(device.free_bytes - int(device.memory_bytes * FREE_RESERVE), 0))
        budget = pool_bytes // max(bytes_per_slot, 1)
        num_slots = min(budget, max_running * wanted_context + 1)
    # A context the pool cannot hold would refuse nothing at admission and stall later.
    max_context = s.max_context or max(2, min(wanted_context, num_slots - 1))
    if not s.max_context:
        auto.append("max_context")
    return Limits(max_running, max_step_tokens, min(prefill_chunk, max_step_tokens), max_context, num_slots,
                  tuple(auto))
