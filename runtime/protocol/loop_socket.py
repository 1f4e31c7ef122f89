"""A plain ZeroMQ socket driven by the asyncio event loop, without zmq.asyncio's per-call futures.

Sends never wait (``NOBLOCK``: PAIR refuses only without a peer, ROUTER drops only for an
unknown peer, DEALER queues up to its high-water mark). Receives try the socket first and
only wait for its file descriptor when it is empty. ZeroMQ signals that descriptor on
edges, and any send or receive may consume the edge, so every operation re-checks
``zmq.EVENTS`` before anyone sleeps on it. This costs a fraction of zmq.asyncio per message,
which matters on small machines where the scheduler, the worker and the clients share cores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq


class LoopSocket:
    """One zmq socket, one reader at a time (``recv``/``recv_multipart``), sends from anywhere on the loop."""

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.sock = sock
        self._loop = loop or asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._wake)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        else:
            # Nobody waits: reading EVENTS clears the descriptor (the loop would call us again
            # and again otherwise); whether a message is queued stays in EVENTS for the reader.
            self.sock.getsockopt(zmq.EVENTS)

    def _readable(self) -> bool:
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def send(self, data: bytes) -> None:
        """Send one frame now (raises ``zmq.Again`` where the socket type refuses)."""
        try:
            self.sock.send(data, zmq.NOBLOCK)
        finally:
            self._after_send()  # a refused send processes commands too, and may take the edge

    def send_multipart(self, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        finally:
            self._after_send()

    def _after_send(self) -> None:
        if self._waiter is not None and self._readable():
            self._wake()  # the send may have consumed the edge a waiting reader needs

    async def _wait(self, timeout: float | None) -> bool:
        """Until the socket may be readable (True) or ``timeout`` seconds pass (False)."""
        assert self._waiter is None, "one reader at a time"
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = self._loop.call_later(timeout, _resolve, waiter, False) if timeout is not None else None
        try:
            if self._readable():  # a message that arrived before the waiter existed
                return True
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def recv(self, timeout: float | None = None) -> bytes | None:
        """The next message's single frame, or None after ``timeout`` seconds without one."""
        return await self._receive(self.sock.recv, timeout)

    async def recv_multipart(self, timeout: float | None = None) -> list[bytes] | None:
        """The next message's frames, or None after ``timeout`` seconds without one."""
        return await self._receive(self.sock.recv_multipart, timeout)

    async def _receive(self, read: Callable[[int], Any], timeout: float | None) -> Any:
        while True:
            try:
                return read(zmq.NOBLOCK)
            except zmq.Again:
                pass
            if not await self._wait(timeout) and not self._readable():
                return None

    def close(self) -> None:
        """Stop watching the descriptor and close the socket (pending messages are dropped)."""
        self._loop.remove_reader(self._fd)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()
        self.sock.close(0)


def _resolve(waiter: asyncio.Future, value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)
