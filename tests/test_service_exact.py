"""End to end through `runtime up` and the client: token-exact against mlx-lm greedy."""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import pytest
from conftest import running_service
from model_factory import reference_greedy
from near_tie import assert_greedy_like_mlx

from runtime.client import Client

ARCHS = ["llama", "qwen3"]
EXTRA = "[cache]\nkv_slots = 4096\n[scheduler]\nmax_running = 16\nmax_context = 512\ndebug_invariants = true\n"


@pytest.fixture(scope="module", params=ARCHS)
def served(request, model_dir, tmp_path_factory):
    folder = model_dir(request.param)
    with running_service(tmp_path_factory.mktemp("svc"), folder, EXTRA) as svc:
        yield folder, svc


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(1, 80))] for _ in range(count)]


async def test_single_request_exact(served):
    folder, svc = served
    prompt = _prompts(1, 1)[0]
    async with Client(svc.address, timeout_s=60) as client:
        result = await client.generate(token_ids=prompt, max_tokens=20, ignore_eos=True)
    assert result.finish_reason == "length"
    assert result.token_ids == reference_greedy(folder, prompt, 20)
    assert result.prompt_tokens == len(prompt)


async def test_sixteen_staggered_requests_exact(served):
    """Requests join one by one (each after the previous streamed a token) and leave at different times."""
    folder, svc = served
    rng = random.Random(7)
    prompts = _prompts(2, 16)
    budgets = [rng.randint(1, 30) for _ in prompts]
    started = [asyncio.Event() for _ in prompts]

    async with Client(svc.address, timeout_s=60) as client:

        async def one(i: int) -> list[int]:
            if i > 0:
                await started[i - 1].wait()
            ids: list[int] = []
            async for chunk in client.stream(token_ids=prompts[i], max_tokens=budgets[i], ignore_eos=True):
                ids.extend(chunk.token_ids)
                started[i].set()
            started[i].set()
            return ids

        outputs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        status = await client.status()
    for prompt, budget, got in zip(prompts, budgets, outputs):
        assert_greedy_like_mlx(folder, prompt, got, budget)
    assert status.running == 0 and status.waiting == 0
    assert status.kv_slots_free + status.kv_slots_cached == status.kv_slots_total


async def test_stream_equals_generate(served):
    _, svc = served
    prompt = _prompts(3, 1)[0]
    async with Client(svc.address, timeout_s=60) as client:
        whole = await client.generate(token_ids=prompt, max_tokens=25, ignore_eos=True)
        stream = client.stream(token_ids=prompt, max_tokens=25, ignore_eos=True)
        chunks = [c async for c in stream]
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert stream.result.token_ids == whole.token_ids and stream.result.finish_reason == "length"
    assert stream.result.cached_tokens == len(prompt) - 1  # the same prompt again: a full-prefix hit


async def test_stop_token_ids_and_max_tokens(served):
    folder, svc = served
    prompt = _prompts(4, 1)[0]
    ref = reference_greedy(folder, prompt, 30)
    stop = ref[5]
    expected = ref[: ref.index(stop) + 1]
    async with Client(svc.address, timeout_s=60) as client:
        stopped = await client.generate(token_ids=prompt, max_tokens=30, stop_token_ids=[stop])
        limited = await client.generate(token_ids=prompt, max_tokens=3, ignore_eos=True)
    assert stopped.finish_reason == "stop" and stopped.token_ids == expected
    assert limited.finish_reason == "length" and limited.token_ids == ref[:3]


async def test_eos_stops_unless_ignored(model_dir, tmp_path):
    """A model whose config names a token it greedily produces as EOS stops there."""
    base = model_dir("llama")
    prompt = _prompts(5, 1)[0]
    ref = reference_greedy(base, prompt, 30)
    eos = ref[4]
    folder = tmp_path / "eos-model"
    shutil.copytree(base, folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos]
    (folder / "config.json").write_text(json.dumps(config))
    with running_service(tmp_path, folder, EXTRA) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            stopped = await client.generate(token_ids=prompt, max_tokens=30)
            ignored = await client.generate(token_ids=prompt, max_tokens=30, ignore_eos=True)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ref[: ref.index(eos) + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == ref


async def test_abort_mid_generation_frees_slots(model_dir, tmp_path):
    folder = model_dir("llama")
    extra = EXTRA.replace("[cache]\n", "[cache]\nenabled = false\n")
    with running_service(tmp_path, folder, extra) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            before = await client.status()
            rid = "to-abort"
            got: list[int] = []
            stream = client.stream(token_ids=_prompts(6, 1)[0], max_tokens=400, ignore_eos=True, rid=rid)
            async for chunk in stream:
                got.extend(chunk.token_ids)
                if len(got) >= 3:
                    assert await client.abort(rid) is True
                    break
            await stream.aclose()
            assert await client.abort("no-such-request") is False
            # The service still serves after the abort (and by then the aborted request's
            # launched steps have come back, so its slots are released).
            ok = await client.generate(token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)
            after = await client.status()
    assert ok.finish_reason == "length"
    assert after.running == 0
    assert after.kv_slots_free == before.kv_slots_free
