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
loaded (CUDA), by that less a reserve for the steps' own buffers (``FREE_RESERVE``). A hybrid
model's recurrent-state pool (``cache.aux_slots`` 0) gets a share of its own, the same fraction
(where memory is known to be free, the two together fit it): ``AUX_SLOTS_PER_ROW`` slots a
running row where they fit, else fewer, and fewer running rows (``max_running`` 0) where not even
``AUX_MIN_PER_ROW`` fit beside the decode step's own states (``AUX_WORKING_PER_ROW``): a state
of Qwen3-Next-80B's is 74 MB, and 8 per row of 256 rows would be 150 GB. The
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
AUX_SLOTS_PER_ROW = 8  # recurrent-state slots a running row: its live state, its prefill's snapshots, cached prefixes
AUX_MIN_PER_ROW = 3  # a row's live state and its prefill's two snapshots (scheduler/aux_state.py)
AUX_WORKING_PER_ROW = 2  # a decode step's states beside the pool: the resident batch's and the new ones


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
    aux_slots: int = 0  # recurrent-state slots, the reserved slot 0 included (0: no hybrid layers)

    def describe(self) -> str:
        """One line for the start-up log: every limit, marked where it was chosen here."""
        def show(key: str) -> str:
            return f"{key} {getattr(self, key)}" + (" (auto)" if key in self.auto else "")

        keys = ("max_running", "max_step_tokens", "prefill_chunk", "max_context", "num_slots")
        line = ", ".join(show(k) for k in keys + (("aux_slots",) if self.aux_slots else ()))
        rows = (self.aux_slots - 1) // AUX_MIN_PER_ROW
        if self.aux_slots and rows < self.max_running:  # admission waits for state slots past that
            line += f" (state slots for {rows} rows' prefills at once, {AUX_MIN_PER_ROW} a row)"
        return line


def device_rows(device: Device, context: int = 0, bytes_per_slot: int = 0) -> int:
    """Running rows for a GPU of this much memory; on a CPU 64, or as many as the row cache
    holds at ``context`` positions of ``bytes_per_slot`` (one more each: its scratch position)."""
    if not device.gpu:
        return max(1, min(64, ROW_CACHE_BYTES // max((context + 1) * bytes_per_slot, 1)))
    if device.memory_bytes >= 64 * GIB:
        return 256
    return 128 if device.memory_bytes >= 24 * GIB else 64


def choose(config: Config, device: Device, model_context: int, bytes_per_slot: int,
           aux_bytes_per_slot: int = 0) -> Limits:
    """Every limit: the config's where it sets one, else the device's default (see module doc).

    ``model_context``: the model's ``max_position_embeddings``; ``bytes_per_slot``: one
    token's K/V over every attention layer (0 for a model without attention);
    ``aux_bytes_per_slot``: one recurrent-state slot over every hybrid layer (0: none).
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
    share = int(device.memory_bytes * c.kv_memory_fraction)  # each pool's, KV and recurrent state
    room = device.free_bytes - int(device.memory_bytes * FREE_RESERVE) if device.free_bytes else None
    aux_slots, aux_bytes = 0, 0
    if aux_bytes_per_slot:
        aux_share = share
        if room is not None:  # the KV pool's wish first; where both do not fit, at least half the room
            kv_wanted = c.kv_slots * bytes_per_slot or min(share, max_running * wanted_context * bytes_per_slot)
            aux_share = min(share, max(room - kv_wanted, room // 2, 0))
        max_running, aux_slots = _aux_slots(aux_share, aux_bytes_per_slot, max_running, c.aux_slots,
                                            "max_running" in auto)
        aux_bytes = (aux_slots + 1 + AUX_WORKING_PER_ROW * max_running) * aux_bytes_per_slot
        if not c.aux_slots:
            auto.append("aux_slots")
    max_step_tokens = pick("max_step_tokens", s.max_step_tokens, 2048 if device.gpu else 512)
    prefill_chunk = pick("prefill_chunk", s.prefill_chunk, 512 if device.gpu else 256)
    num_slots = c.kv_slots
    if not num_slots:
        auto.append("num_slots")
        pool_bytes = share
        if room is not None:  # another process (or our own weights) may hold much of the device
            pool_bytes = min(pool_bytes, max(room - aux_bytes, 0))
        budget = pool_bytes // max(bytes_per_slot, 1)
        num_slots = min(budget, max_running * wanted_context + 1)
    # A context the pool cannot hold would refuse nothing at admission and stall later.
    max_context = s.max_context or max(2, min(wanted_context, num_slots - 1))
    if not s.max_context:
        auto.append("max_context")
    return Limits(max_running, max_step_tokens, min(prefill_chunk, max_step_tokens), max_context, num_slots,
                  tuple(auto), aux_slots + 1 if aux_bytes_per_slot else 0)


def _aux_slots(budget: int, per_slot: int, max_running: int, configured: int, rows_auto: bool) -> tuple[int, int]:
    """(max_running, recurrent-state slots but the reserved one) for ``budget`` bytes of state
    memory: the configured slots if set, else ``AUX_SLOTS_PER_ROW`` a row where they fit beside
    the decode step's ``AUX_WORKING_PER_ROW`` a row, at least ``AUX_MIN_PER_ROW`` a row (fewer rows,
    where ``max_running`` is the service's choice, until they fit; never fewer than one)."""
    if configured:
        return max_running, configured
    fit = budget // per_slot - 1  # the pool's reserved slot 0 too
    if rows_auto:
        max_running = max(1, min(max_running, fit // (AUX_MIN_PER_ROW + AUX_WORKING_PER_ROW)))
    slots = min(AUX_SLOTS_PER_ROW * max_running, fit - AUX_WORKING_PER_ROW * max_running)
    return max_running, max(slots, AUX_MIN_PER_ROW)
