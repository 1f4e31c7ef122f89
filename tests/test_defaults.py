"""Limits chosen for the device where the config leaves them unset, and the chunk policy."""

from __future__ import annotations

import re

from runtime.config import parse_config
from runtime.scheduler.admission import Limits as SchedLimits
from runtime.scheduler.core import Scheduler
from runtime.scheduler.request import Request, SamplingParams
from runtime.worker.defaults import AUX_MIN_PER_ROW, AUX_WORKING_PER_ROW, GIB, ROW_CACHE_BYTES, Device, choose

KIB = 1024


def _config(**scheduler) -> object:
    return parse_config({"model": {"path": "/m"}, "scheduler": scheduler})


def test_cpu_defaults_keep_the_row_cache_sized_context():
    lim = choose(_config(), Device("cpu", 24 * GIB), model_context=32768, bytes_per_slot=2 * KIB)
    assert (lim.max_running, lim.max_step_tokens, lim.prefill_chunk, lim.max_context) == (64, 512, 256, 4096)
    assert lim.num_slots == 64 * 4096 + 1  # the pool budget (6 GiB / 2 KiB) is larger than that
    assert set(lim.auto) == {"max_running", "max_step_tokens", "prefill_chunk", "max_context", "num_slots"}
    assert "max_running 64 (auto)" in lim.describe()


def test_cpu_runs_as_many_rows_as_the_row_cache_holds():
    """The row cache holds every running row's whole context (and a scratch position) in
    ``ROW_CACHE_BYTES``; past that decode would gather from the pool, uncompiled."""
    for per_slot, rows in ((8 * KIB, 63), (12 * KIB, 42), (32 * KIB, 15), (128 * KIB, 3), (4 * 2**20, 1)):
        lim = choose(_config(), Device("cpu", 24 * GIB), model_context=32768, bytes_per_slot=per_slot)
        assert lim.max_running == rows, per_slot
        assert lim.max_running * (lim.max_context + 1) * per_slot <= ROW_CACHE_BYTES or rows == 1
    short = choose(_config(), Device("cpu", 24 * GIB), model_context=1024, bytes_per_slot=16 * KIB)
    assert short.max_running == 64  # a short context leaves room for every row
    configured = choose(_config(max_running=64), Device("cpu", 24 * GIB), model_context=32768,
                        bytes_per_slot=32 * KIB)
    assert configured.max_running == 64  # the config's choice stands
    gpu = choose(_config(), Device("cuda", 80 * GIB), model_context=32768, bytes_per_slot=32 * KIB)
    assert gpu.max_running == 256  # a GPU's rows do not follow the row cache


def test_large_gpu_gets_big_steps_many_rows_and_the_models_context():
    # An 8B Llama shape: 32 layers x 8 KV heads x 128 dims x K and V x bf16 = 128 KiB a token.
    lim = choose(_config(), Device("cuda", 139 * GIB), model_context=131072, bytes_per_slot=128 * KIB)
    assert (lim.max_running, lim.max_step_tokens, lim.prefill_chunk) == (256, 2048, 512)
    assert lim.num_slots == int(139 * GIB * 0.25) // (128 * KIB)
    assert lim.max_context == 131072


def test_the_pool_leaves_what_is_free_after_the_weights_less_a_reserve():
    # An 80 GB card with 16 GiB of weights loaded and another 36 GiB held by another process
    lim = choose(_config(), Device("cuda", 80 * GIB, free_bytes=28 * GIB), model_context=131072,
                 bytes_per_slot=128 * KIB)
    assert lim.num_slots == (28 * GIB - int(80 * GIB * 0.15)) // (128 * KIB)  # not 20 GiB: that would not fit
    roomy = choose(_config(), Device("cuda", 80 * GIB, free_bytes=64 * GIB), model_context=131072,
                   bytes_per_slot=128 * KIB)
    assert roomy.num_slots == 20 * GIB // (128 * KIB)  # the share of memory, where it fits


def test_small_gpu_context_is_bounded_by_the_pool():
    lim = choose(_config(), Device("metal", 16 * GIB), model_context=131072, bytes_per_slot=128 * KIB)
    assert lim.max_running == 64
    assert lim.num_slots == 4 * GIB // (128 * KIB)
    assert lim.max_context == lim.num_slots - 1


def test_mid_gpu_rows():
    lim = choose(_config(), Device("cuda", 32 * GIB), model_context=8192, bytes_per_slot=32 * KIB)
    assert lim.max_running == 128 and lim.max_context == 8192


def test_config_values_win_and_are_not_marked_auto():
    config = parse_config({"model": {"path": "/m"}, "cache": {"kv_slots": 1000},
                           "scheduler": {"max_running": 3, "max_step_tokens": 100, "prefill_chunk": 50,
                                         "max_context": 700}})
    lim = choose(config, Device("cuda", 139 * GIB), model_context=131072, bytes_per_slot=128 * KIB)
    assert (lim.max_running, lim.max_step_tokens, lim.prefill_chunk, lim.max_context, lim.num_slots) == (
        3, 100, 50, 700, 1000)
    assert lim.auto == ()
    assert "(auto)" not in lim.describe()


def test_unset_context_is_bounded_by_a_configured_pool():
    config = parse_config({"model": {"path": "/m"}, "cache": {"kv_slots": 300}})
    lim = choose(config, Device("cpu", 24 * GIB), model_context=2048, bytes_per_slot=KIB)
    assert lim.max_context == 299 and "num_slots" not in lim.auto


def _scheduler(budget: int, chunk: int) -> Scheduler:
    limits = SchedLimits(4096, 4, 4096, 100, max_step_tokens=budget, prefill_chunk=chunk)
    return Scheduler(limits, frozenset({0}), debug_invariants=True)


def _add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> Request:
    r = Request(rid=rid, prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                max_new=s.validate(prompt, max_tokens, 0.0))
    s.add(r)
    return r


def test_a_lone_prompt_takes_the_whole_step_budget():
    s = _scheduler(budget=64, chunk=16)
    _add(s, "long", [5] * 150, 2)
    sizes = []
    while (planned := s.next_step()) is not None and planned.step.prefills:
        sizes.extend(len(c.token_ids) for c in planned.step.prefills)  # one forward per step
        s.on_step_done(planned.step.step_id, [7] * len(planned.decode_reqs))
    assert sizes == [64, 64, 21]  # the last prompt token is the first decode's input
    s.check_invariants()


def test_with_rows_decoding_a_prompt_is_chunked():
    s = _scheduler(budget=64, chunk=16)
    _add(s, "short", [1, 2], 50)
    first = s.next_step()
    s.on_step_done(first.step.step_id, [7] * len(first.decode_reqs))
    _add(s, "long", [5] * 150, 2)
    planned = s.next_step()
    # Chunks of prefill_chunk, whole ones only, within what the decoding row leaves of the budget.
    assert [len(c.token_ids) for c in planned.step.prefills] == [16, 16, 16]
    assert len(planned.decode_reqs) == 1


def test_service_without_limits_reports_what_it_chose(model_dir, service_factory):
    from runtime.client import SyncClient
    from runtime.worker.loader import device

    with service_factory(model_dir("llama")) as svc:
        line = next(ln for ln in svc.lines if "runtime: limits:" in ln)
        # Each start-up stage says how long it took, in order (the GPU's slow ones are named).
        stages = ("loaded the model in", "pools and attention paths ready in", "warmed up in")
        found = [next(i for i, ln in enumerate(svc.lines) if stage in ln) for stage in stages]
        assert found == sorted(found)
        load_line = svc.lines[found[0]]
        assert re.search(r"imports \d+\.\d s, device set-up \d+\.\d s", load_line), load_line
        paths_line = svc.lines[found[1]]
        assert re.search(r"ready in \d+\.\d s \(pools \d+\.\d s, attention paths \d+\.\d s", paths_line), paths_line
        with SyncClient(svc.address) as client:
            status = client.status(timeout=15.0)
            for key in ("max_running", "max_step_tokens", "prefill_chunk", "max_context"):
                assert f"{key} {getattr(status, key)} (auto)" in line
            if device().kind == "cpu":  # the machine CI runs on; a GPU gets the GPU defaults
                assert (status.max_running, status.max_step_tokens, status.prefill_chunk) == (64, 512, 256)
            else:
                assert (status.max_step_tokens, status.prefill_chunk) == (2048, 512)
            assert len(client.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True).token_ids) == 4
            after = client.status(timeout=15.0)
            # Warm-up ran a prefill and traced the compiled decode step; the request added a shape.
            assert after.worker_prefill_shapes >= 2 and after.worker_decode_traces >= 1


def _pools(lim, kv_per_slot: int, aux_per_slot: int) -> int:
    """Bytes of the KV pool, the recurrent-state pool and a decode step's states beside it."""
    return lim.num_slots * kv_per_slot + (lim.aux_slots + AUX_WORKING_PER_ROW * lim.max_running) * aux_per_slot


def test_a_hybrid_with_small_states_keeps_eight_state_slots_a_row():
    lim = choose(_config(), Device("cuda", 80 * GIB, free_bytes=60 * GIB), model_context=32768,
                 bytes_per_slot=32 * KIB, aux_bytes_per_slot=64 * KIB)
    assert lim.max_running == 256 and lim.aux_slots == 8 * 256 + 1
    assert "aux_slots 2049 (auto)" in lim.describe()
    plain = choose(_config(), Device("cuda", 80 * GIB, free_bytes=60 * GIB), model_context=32768,
                   bytes_per_slot=32 * KIB)
    assert plain.aux_slots == 0 and "aux_slots" not in plain.describe()


def test_a_hybrid_with_large_states_runs_fewer_rows_within_the_memory_it_has():
    # Qwen3-Next-80B's states: 36 delta-net layers x 2 MiB, and its conv states: about 74 MB a slot;
    # 8 a row of 256 rows would be 150 GB. A 4-bit copy's weights (45 GB) loaded on a 141 GB card.
    per_slot, kv = 74 * 10**6, 24 * KIB
    memory, free = 141 * 10**9, 96 * 10**9
    lim = choose(_config(), Device("cuda", memory, free_bytes=free), model_context=262144, bytes_per_slot=kv,
                 aux_bytes_per_slot=per_slot)
    share = int(memory * 0.25)
    assert lim.max_running == share // (per_slot * (AUX_MIN_PER_ROW + AUX_WORKING_PER_ROW)) < 256
    assert AUX_MIN_PER_ROW * lim.max_running <= lim.aux_slots - 1 <= 8 * lim.max_running
    assert (lim.aux_slots - 1 + AUX_WORKING_PER_ROW * lim.max_running) * per_slot <= share
    assert _pools(lim, kv, per_slot) <= free - int(memory * 0.15)  # the reserve stays free
    # The same model where the device says nothing of free memory (a Mac): the same share.
    mac = choose(_config(), Device("metal", 192 * GIB), model_context=262144, bytes_per_slot=kv,
                 aux_bytes_per_slot=per_slot)
    assert (mac.aux_slots - 1 + AUX_WORKING_PER_ROW * mac.max_running) * per_slot <= 192 * GIB // 4


def test_tight_memory_splits_the_room_between_the_pools():
    memory, free = 80 * GIB, 28 * GIB  # room: 16 GiB for both pools
    room = free - int(memory * 0.15)
    lim = choose(_config(), Device("cuda", memory, free_bytes=free), model_context=131072, bytes_per_slot=128 * KIB,
                 aux_bytes_per_slot=32 * 2**20)
    assert _pools(lim, 128 * KIB, 32 * 2**20) <= room
    assert lim.num_slots * 128 * KIB >= room // 2 - 32 * 2**20  # the KV pool keeps about half


def test_configured_rows_and_state_slots_stand():
    config = parse_config({"model": {"path": "/m"}, "cache": {"aux_slots": 40}, "scheduler": {"max_running": 100}})
    lim = choose(config, Device("cuda", 80 * GIB, free_bytes=60 * GIB), model_context=32768, bytes_per_slot=32 * KIB,
                 aux_bytes_per_slot=74 * 10**6)
    assert (lim.max_running, lim.aux_slots) == (100, 41)
    assert "aux_slots 41" in lim.describe() and "aux_slots 41 (auto)" not in lim.describe()
    rows_only = choose(_config(max_running=100), Device("cuda", 80 * GIB, free_bytes=60 * GIB), model_context=32768,
                       bytes_per_slot=32 * KIB, aux_bytes_per_slot=74 * 10**6)
    assert rows_only.max_running == 100  # the config's rows stand: state slots are what fits, three at least
    assert f"state slots for {(rows_only.aux_slots - 1) // AUX_MIN_PER_ROW} rows' prefills" in rows_only.describe()
    assert rows_only.aux_slots - 1 == max(AUX_MIN_PER_ROW, 20 * GIB // (74 * 10**6) - 1 - AUX_WORKING_PER_ROW * 100)
