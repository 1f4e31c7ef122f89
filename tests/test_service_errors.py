"""Bad input gets a clear error and the service keeps serving; a dead worker is replaced."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import pytest
import zmq
import zmq.asyncio
from conftest import running_service
from model_factory import reference_greedy

from runtime.client import Client
from runtime.protocol import client as cp


async def wait_worker_up(client: Client, timeout: float = 60.0):
    """Poll status until a worker serves again; the status then."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status = await client.status()
        if status.worker_state == "up":
            return status
        assert asyncio.get_running_loop().time() < deadline, "the worker did not come back"
        await asyncio.sleep(0.1)


EXTRA = "[cache]\nkv_slots = 1024\n[scheduler]\nmax_running = 8\nmax_context = 256\n"


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    folder = model_dir("llama")
    with running_service(tmp_path_factory.mktemp("svc"), folder, EXTRA) as svc:
        yield folder, svc


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(token_ids=[]), "empty"),
        (dict(prompt=""), "empty"),
        (dict(token_ids=[1] * 300), "context"),
        (dict(token_ids=[3, 99999]), "unknown token ids"),
        (dict(token_ids=[3, -1]), "unknown token ids"),
        (dict(token_ids=[3, 4], max_tokens=0), "max_tokens"),
        (dict(token_ids=[3, 4], temperature=-1.0), "temperature"),
        (dict(), "exactly one of prompt, token_ids or messages"),
    ],
)
async def test_bad_requests_get_error_replies(served, kwargs, needle):
    folder, svc = served
    async with Client(svc.address, timeout_s=30) as client:
        bad = await client.generate(**kwargs)
        good = await client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert bad.finish_reason == "error"
    assert needle in bad.error
    assert good.token_ids == reference_greedy(folder, [5, 6, 7], 4)


async def test_malformed_and_mistyped_messages(served):
    folder, svc = served
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.address)
    try:
        await sock.send(b"\xc1 not msgpack")
        reply = cp.server_msg_decoder.decode(await asyncio.wait_for(sock.recv(), 10))
        assert isinstance(reply, cp.ProtocolError) and "malformed" in reply.message
        wrong = msgspec.msgpack.encode({"type": "generate", "rid": "w1", "token_ids": "abc"})
        await sock.send(wrong)
        reply = cp.server_msg_decoder.decode(await asyncio.wait_for(sock.recv(), 10))
        assert isinstance(reply, cp.ProtocolError) and reply.rid == "w1" and "token_ids" in reply.message
        unknown = msgspec.msgpack.encode({"type": "launch_missiles", "rid": "w2"})
        await sock.send(unknown)
        reply = cp.server_msg_decoder.decode(await asyncio.wait_for(sock.recv(), 10))
        assert isinstance(reply, cp.ProtocolError) and reply.rid == "w2"
    finally:
        sock.close(0)
        ctx.term()
    async with Client(svc.address, timeout_s=30) as client:
        good = await client.generate(token_ids=[9, 8, 7], max_tokens=3, ignore_eos=True)
    assert good.token_ids == reference_greedy(folder, [9, 8, 7], 3)


async def test_request_ids_are_scoped_to_their_connection(served):
    folder, svc = served
    async with Client(svc.address, timeout_s=30) as client:
        stream = client.stream(token_ids=[5, 6], max_tokens=200, ignore_eos=True, rid="dup")
        await stream.__anext__()  # the first request is running
        with pytest.raises(ValueError, match="in use"):
            await client.generate(token_ids=[5, 6], max_tokens=2, rid="dup")
        async with Client(svc.address, timeout_s=30) as other:
            theirs = await other.generate(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True, rid="dup")
            assert await other.abort("dup") is False  # another connection's request: not found
        assert await client.abort("dup") is True
        async for _ in stream:
            pass
    assert theirs.token_ids == reference_greedy(folder, [5, 6, 7], 3)
    assert stream.result.finish_reason == "abort"


async def test_worker_death_fails_inflight_and_restarts(model_dir, tmp_path):
    folder = model_dir("llama")
    with running_service(tmp_path, folder, EXTRA) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            status = await client.status()
            stream = client.stream(token_ids=[5, 6, 7, 8], max_tokens=250, ignore_eos=True)
            failure = None
            try:
                async for _ in stream:
                    os.kill(status.worker_pid, signal.SIGKILL)
            except Exception as exc:  # RequestFailed
                failure = exc
            assert failure is not None and "worker died" in str(failure)
            meanwhile = await client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
            assert (await client.status()).worker_state == "restarting"
            after = await wait_worker_up(client)
            result = await client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert meanwhile.finish_reason == "error" and "worker unavailable, retrying" in meanwhile.error
    assert result.token_ids == reference_greedy(folder, [5, 6, 7], 4)
    assert after.worker_restarts == 1 and after.worker_pid != status.worker_pid


async def test_temperature_sampling_returns_valid_tokens(served):
    _, svc = served
    async with Client(svc.address, timeout_s=30) as client:
        hot = await client.generate(token_ids=[5, 6, 7], max_tokens=12, temperature=1.5, ignore_eos=True)
    assert hot.finish_reason == "length" and len(hot.token_ids) == 12
    assert all(0 <= t < 256 for t in hot.token_ids)
