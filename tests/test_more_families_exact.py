"""The families of ``tests/factory_families`` token-exact against mlx-lm beyond batched decode.

``test_gemma2_exact`` decodes every family batched at the head-count batch sizes; here each of
these families (no test file of their own) also runs one request alone, a new suffix on its
cached prefix beside an exact repeat (a whole-prompt hit), and prompts prefilled in chunks
smaller than themselves, several chunks sharing one step. The families the runtime refuses
(``REFUSED``) must be refused at load with a message naming why.
"""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from model_factory import MORE_ARCHS, REFUSED, reference_greedy

from runtime.worker.model.discovery import UnsupportedModel

TRACK_CHUNK = 8  # a recurrent family reuses a prefix at multiples of this
SERVED = tuple(a for a in MORE_ARCHS if a not in REFUSED)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_family_is_refused_at_load_with_its_reason(arch, model_dir):
    with pytest.raises(UnsupportedModel, match=REFUSED[arch]):
        InProcessService(model_dir(arch), max_running=8, aux_slots=64)


def _assert_exact(folder, reqs) -> None:
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize("arch", SERVED)
def test_one_request_then_prefix_hits(arch, model_dir):
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, aux_slots=64, track_chunk=TRACK_CHUNK)
    rng = random.Random(7)
    shared = [rng.randrange(3, 250) for _ in range(2 * TRACK_CHUNK)]
    first = svc.request("first", shared + [rng.randrange(3, 250) for _ in range(3)], 8)
    svc.run({0: [first]})
    suffix = svc.request("suffix", shared + [rng.randrange(3, 250) for _ in range(4)], 6)
    repeat = svc.request("repeat", list(first.prompt_ids), 6)
    svc.run({0: [suffix, repeat]})
    assert suffix.prefix_len >= len(shared) and repeat.prefix_len == len(repeat.prompt_ids) - 1, \
        (suffix.prefix_len, repeat.prefix_len)
    _assert_exact(folder, [first, suffix, repeat])


@pytest.mark.parametrize("arch", SERVED)
def test_chunked_prefill(arch, model_dir):
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, aux_slots=64, prefill_chunk=8, max_step_tokens=16)
    rng = random.Random(3)
    reqs = [svc.request(f"c{i}", [rng.randrange(3, 250) for _ in range(5 + 6 * i)], 6) for i in range(4)]
    reqs.append(svc.request("long", [rng.randrange(3, 250) for _ in range(40)], 6))
    svc.run({0: reqs})
    _assert_exact(folder, reqs)
