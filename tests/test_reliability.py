"""The service under stress: clients that leave or stop reading, floods, a hung or twice-dead worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest
import zmq
from conftest import running_service
from model_factory import reference_greedy
from test_service_errors import wait_worker_up

from runtime.client import Client, RequestFailed, SyncClient
from runtime.protocol import client as cp

LONG = 1500  # tokens: far more than the few hundred steps a test waits for
BASE = "[cache]\nkv_slots = 32768\n[scheduler]\nmax_running = 24\nmax_context = 2048\n"


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    folder = model_dir("llama")
    extra = "slow_client_timeout_s = 3\n" + BASE  # lands in running_service's [server] table
    with running_service(tmp_path_factory.mktemp("svc"), folder, extra) as svc:
        yield folder, svc


def _dealer(ctx: zmq.Context, address: str, **opts) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for key, value in opts.items():
        sock.setsockopt(getattr(zmq, key), value)
    sock.connect(address)
    return sock


def _generate(rid: str, **fields) -> bytes:
    return cp.client_encoder.encode(cp.Generate(rid=rid, token_ids=fields.pop("token_ids", [5, 6, 7]), **fields))


async def _until(client: Client, check, timeout: float) -> cp.StatusReply:
    """Poll status until ``check(status)``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        status = await client.status(timeout=15.0)  # generous: CI machines are small and busy
        if check(status):
            return status
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {status}"
        await asyncio.sleep(0.05)


def _idle(status: cp.StatusReply) -> bool:
    return status.running == 0 and status.waiting == 0


async def test_departed_clients_have_their_requests_aborted_within_a_second(served):
    _, svc = served
    ctx = zmq.Context()
    socks = [_dealer(ctx, svc.address) for _ in range(12)]
    async with Client(svc.address, timeout_s=30) as client:
        idle = await _until(client, _idle, 30)
        for i, sock in enumerate(socks):
            sock.send(_generate(f"d{i}", max_tokens=LONG, ignore_eos=True, stream=True))
        for sock in socks:  # three tokens each, then the client goes away
            got = 0
            while got < 3:
                assert sock.poll(30000), "no chunk within 30 s"
                msg = cp.server_msg_decoder.decode(sock.recv())
                items = msg.chunks if isinstance(msg, cp.ChunkBatch) else [msg]
                got += sum(len(c.token_ids) for c in items if isinstance(c, cp.Chunk))
            sock.close(0)
        held = idle.kv_slots_free + idle.kv_slots_cached

        def released(status: cp.StatusReply) -> bool:  # aborted rows drain their in-flight steps first
            return _idle(status) and status.kv_slots_free + status.kv_slots_cached == held

        after = await _until(client, released, 2.0)
        ctx.term()
    assert after.steps - idle.steps < LONG // 2  # aborted, not run to their length
    assert after.clients == 0


async def test_abandoned_streams_and_cancelled_calls_are_aborted(served):
    _, svc = served
    async with Client(svc.address, timeout_s=30) as client:
        await _until(client, _idle, 30)
        stream = client.stream(token_ids=[5, 6], max_tokens=LONG, ignore_eos=True)
        await stream.__anext__()
        await stream.aclose()
        await _until(client, _idle, 2.0)
        async with client.stream(token_ids=[5, 6], max_tokens=LONG, ignore_eos=True) as stream:
            async for _ in stream:
                break
        await _until(client, _idle, 2.0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.generate(token_ids=[5, 6], max_tokens=LONG, ignore_eos=True), 0.5)
        await _until(client, _idle, 2.0)

        def sync_break() -> None:
            with SyncClient(svc.address, timeout_s=30) as sync:
                for _ in sync.stream(token_ids=[5, 6], max_tokens=LONG, ignore_eos=True):
                    break

        steps = (await client.status()).steps
        await asyncio.get_running_loop().run_in_executor(None, sync_break)
        after = await _until(client, _idle, 2.0)
    assert after.steps - steps < LONG // 2


async def test_a_late_reader_gets_every_reply(served):
    _, svc = served
    ctx = zmq.Context()
    sock = _dealer(ctx, svc.address, SNDHWM=0, RCVHWM=1)
    n = 4000
    rids = {f"{i:05d}" + "x" * 240 for i in range(n)}
    for rid in rids:
        sock.send(_generate(rid, max_tokens=1, ignore_eos=True))
    queued = 0
    async with Client(svc.address, timeout_s=30) as client:
        # Not reading: the service must hold the replies. The slow-client clock starts at the
        # first reply the socket refuses, so reading as soon as some are queued stays well
        # within slow_client_timeout_s = 3 however slow a loaded machine makes the service.
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and queued == 0:
            queued = (await client.status()).replies_queued
            await asyncio.sleep(0.05)
    got: dict[str, str] = {}
    while len(got) < n and sock.poll(10000):
        msg = cp.server_msg_decoder.decode(sock.recv())
        if isinstance(msg, cp.Done):
            assert msg.rid not in got, "two replies for one request"
            got[msg.rid] = msg.finish_reason
    sock.close(0)
    ctx.term()
    assert set(got) == rids and set(got.values()) == {"length"}
    assert queued > 0  # more replies than the socket buffers hold waited in the scheduler


async def test_a_client_that_never_reads_is_cut_off(served):
    folder, svc = served
    ctx = zmq.Context()
    sock = _dealer(ctx, svc.address, SNDHWM=0, RCVHWM=1)
    for i in range(16):
        sock.send(_generate(f"s{i}" + "y" * 240, max_tokens=LONG, ignore_eos=True, stream=True))
    for i in range(3000):
        sock.send(_generate(f"n{i}" + "y" * 240, max_tokens=1, ignore_eos=True))
    async with Client(svc.address, timeout_s=30) as client:
        status = await _until(client, lambda s: s.replies_queued > 0, 30)
        assert status.running > 0
        after = await _until(client, lambda s: _idle(s) and s.clients == 0, 20)  # slow_client_timeout_s = 3
        good = await client.generate(token_ids=[9, 8, 7], max_tokens=4, ignore_eos=True)
    sock.close(0)
    ctx.term()
    assert after.replies_queued == 0
    assert good.token_ids == reference_greedy(folder, [9, 8, 7], 4)


async def test_a_flood_past_max_waiting_is_refused_at_once_and_every_request_answered(model_dir, tmp_path):
    folder = model_dir("llama")
    extra = "[cache]\nkv_slots = 4096\n[scheduler]\nmax_running = 4\nmax_context = 256\nmax_waiting = 20\n"
    with running_service(tmp_path, folder, extra) as svc:
        ctx = zmq.Context()
        sock = _dealer(ctx, svc.address, SNDHWM=0)
        n = 300
        for i in range(n):
            sock.send(_generate(f"f{i}", max_tokens=40, ignore_eos=True))
        replies: dict[str, cp.Done] = {}
        while len(replies) < n and sock.poll(30000):
            msg = cp.server_msg_decoder.decode(sock.recv())
            if isinstance(msg, cp.Done):
                assert msg.rid not in replies, "two replies for one request"
                replies[msg.rid] = msg
        sock.close(0)
        ctx.term()
    assert len(replies) == n
    refused = [d for d in replies.values() if d.finish_reason == "error"]
    served_ = [d for d in replies.values() if d.finish_reason == "length"]
    assert refused and served_ and len(refused) + len(served_) == n
    assert all("overloaded" in d.error and "retry" in d.error for d in refused)
    assert all(len(d.token_ids) == 40 for d in served_)


async def test_a_hung_worker_is_detected_killed_and_replaced(model_dir, tmp_path):
    folder = model_dir("llama")
    extra = BASE + "[worker]\nstep_timeout_s = 3\n"
    with running_service(tmp_path, folder, extra) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            before = await client.status()
            streams = [client.stream(token_ids=[5, 6, i], max_tokens=LONG, ignore_eos=True) for i in range(4)]
            for stream in streams:
                await stream.__anext__()
            os.kill(before.worker_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            errors = []
            for stream in streams:
                with pytest.raises(RequestFailed) as failed:
                    async for _ in stream:
                        pass
                errors.append(str(failed.value))
            waited = time.monotonic() - stopped_at
            after = await wait_worker_up(client)
            result = await client.generate(token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)
        with pytest.raises(ProcessLookupError):
            os.kill(before.worker_pid, 0)  # the stopped worker was killed, not left behind
    assert all("worker stopped responding" in e for e in errors)
    assert waited < 3 + 10  # the timeout plus the loop's poll, not forever
    assert after.worker_pid != before.worker_pid and after.worker_restarts == 1
    assert result.token_ids == reference_greedy(folder, [5, 6, 7], 6)


async def test_a_worker_killed_while_restarting_is_restarted_again(model_dir, tmp_path):
    folder = model_dir("llama")
    with running_service(tmp_path, folder, BASE) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            first = await client.status()
            os.kill(first.worker_pid, signal.SIGKILL)
            loading = await _until(client, lambda s: s.worker_pid not in (0, first.worker_pid), 30)
            assert loading.worker_state == "restarting"
            os.kill(loading.worker_pid, signal.SIGKILL)
            refused = await client.generate(token_ids=[5, 6, 7], max_tokens=4)
            after = await wait_worker_up(client)
            result = await client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert refused.finish_reason == "error" and "worker unavailable, retrying" in refused.error
    assert after.worker_restarts == 2 and after.worker_pid not in (first.worker_pid, loading.worker_pid)
    assert result.token_ids == reference_greedy(folder, [5, 6, 7], 4)


def test_status_reports_the_limits():
    reply = cp.StatusReply(
        rid="", model="m", model_type="llama", waiting=0, running=0, kv_slots_total=1, kv_slots_free=1,
        kv_slots_cached=0, worker_restarts=0, max_context=8, worker_pid=1,
    )
    decoded = cp.server_msg_decoder.decode(msgspec.msgpack.encode(reply))
    assert decoded.worker_state == "up" and decoded.replies_queued == 0


async def test_long_prompt_texts_are_limited_and_tokenized_beside_running_streams(served):
    _, svc = served
    async with Client(svc.address, timeout_s=60) as client:
        stream = client.stream(token_ids=[5, 6], max_tokens=200, ignore_eos=True)
        await stream.__anext__()
        too_big = await client.generate(prompt="7" * 200_000)  # over 32 bytes per token of context
        long = await client.generate(prompt="7 " * 20_000)  # tokenized on the thread, then too long
        got = 1
        async for chunk in stream:
            got += len(chunk.token_ids)
    assert too_big.finish_reason == "error" and "bytes" in too_big.error
    assert long.finish_reason == "error" and "context" in long.error
    assert got == 200 and stream.result.finish_reason == "length"
