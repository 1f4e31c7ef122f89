"""The admission window: requests reaching an idle service wait for the rest of their burst."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import running_service
from model_factory import reference_greedy

from runtime.client import Client
from runtime.config import ConfigError, parse_config

WINDOW_S = 0.4
EXTRA = f"[scheduler]\nmax_running = 8\nmax_context = 128\nadmit_window_ms = {WINDOW_S * 1000}\n[cache]\nkv_slots = 1024\n"


async def _first_chunk_at(client: Client, prompt: list[int], started: float, n: int) -> tuple[float, list[int]]:
    first = None
    ids: list[int] = []
    async for chunk in client.stream(token_ids=prompt, max_tokens=n, ignore_eos=True):
        first = first if first is not None else time.monotonic() - started
        ids += chunk.token_ids
    assert first is not None
    return first, ids


async def test_a_burst_at_an_idle_service_waits_for_the_window_and_stays_exact(model_dir, tmp_path):
    """A fresh service is idle: the burst's first request opens the window, the others arrive
    50 ms apart inside it, none starts before it closes, and batching them changes no token."""
    folder = model_dir("llama")
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    with running_service(tmp_path, folder, EXTRA) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            started = time.monotonic()
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(_first_chunk_at(client, prompt, started, 6)))
                await asyncio.sleep(0.05)
            results = await asyncio.gather(*tasks)
    for prompt, (first, ids) in zip(prompts, results):
        assert first >= WINDOW_S * 0.95, "requests reaching an idle service must wait for the admission window"
        assert ids == reference_greedy(folder, prompt, 6)


def test_admit_window_is_validated():
    with pytest.raises(ConfigError, match="admit_window_ms"):
        parse_config({"model": {"path": "/m"}, "scheduler": {"admit_window_ms": -1}})
    config = parse_config({"model": {"path": "/m"}, "scheduler": {"admit_window_ms": 0}})
    assert config.scheduler.admit_window_ms == 0.0
