"""LoopSocket: plain zmq sockets read through the event loop (no lost wake-ups, timeouts, teardown)."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from runtime.protocol.loop_socket import LoopSocket


@pytest.fixture
def pair(tmp_path):
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = f"ipc://{tmp_path}/pair.sock"
    a.bind(address)
    b.connect(address)
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


async def test_a_message_sent_before_the_reader_waits_is_received(pair):
    a, b = pair
    reader = LoopSocket(a)
    b.send(b"early")
    time.sleep(0.05)  # let it arrive while nobody waits: the descriptor's edge is gone by then
    await asyncio.sleep(0)  # the loop sees the descriptor with no waiter and clears it
    assert await reader.recv(timeout=2.0) == b"early"
    reader.close()


async def test_recv_waits_for_a_later_message_and_times_out_without_one(pair):
    a, b = pair
    reader = LoopSocket(a)
    started = time.monotonic()
    assert await reader.recv(timeout=0.1) is None
    assert time.monotonic() - started >= 0.09
    asyncio.get_running_loop().call_later(0.05, b.send, b"late")
    assert await reader.recv(timeout=5.0) == b"late"
    reader.close()


async def test_own_sends_do_not_swallow_a_waiting_readers_wake_up(pair):
    a, b = pair
    side_a, side_b = LoopSocket(a), LoopSocket(b)
    got: list[bytes] = []

    async def read_many(n: int) -> None:
        for _ in range(n):
            msg = await side_a.recv(timeout=5.0)
            assert msg is not None, "a message was sent but the reader never woke"
            got.append(msg)
            side_a.send(b"ack:" + msg)  # sending on the socket the reader waits on

    task = asyncio.create_task(read_many(200))
    for i in range(200):
        side_b.send(str(i).encode())
        assert await side_b.recv(timeout=5.0) == b"ack:" + str(i).encode()
    await asyncio.wait_for(task, 5.0)
    assert got == [str(i).encode() for i in range(200)]
    side_a.close()
    side_b.close()


async def test_multipart_and_close_cancel_a_pending_reader(pair):
    a, b = pair
    reader = LoopSocket(a)
    b.send_multipart([b"x", b"y"])
    assert await reader.recv_multipart(timeout=2.0) == [b"x", b"y"]
    pending = asyncio.create_task(reader.recv())
    await asyncio.sleep(0.01)
    reader.close()
    with pytest.raises(asyncio.CancelledError):
        await pending
