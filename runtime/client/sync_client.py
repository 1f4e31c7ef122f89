"""The blocking client for scripts: ``SyncClient``, the async ``Client`` on a private event loop."""

from __future__ import annotations

import asyncio

from runtime.client.client import Client, GenerationResult
from runtime.protocol import client as cp


class SyncClient:
    """Blocking wrapper for scripts: ``with SyncClient(address) as c: c.generate(prompt="...")``."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        *,
        server_key: str | None = None,
        public_key: str | None = None,
        secret_key: str | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = Client(address, timeout_s=timeout_s, server_key=server_key, public_key=public_key, secret_key=secret_key)

    def __enter__(self) -> SyncClient:
        self._loop.run_until_complete(self._client.__aenter__())
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        return self._loop.run_until_complete(self._client.generate(prompt, **kwargs))

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        return self._loop.run_until_complete(self._client.chat(messages, **kwargs))

    def stream(self, prompt: str | None = None, **kwargs):
        """A plain iterator of GenerationChunk; leaving it early (break, close) aborts the request."""
        agen = self._client.stream(prompt, **kwargs)
        try:
            while True:
                try:
                    yield self._loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._loop.run_until_complete(agen.aclose())

    def abort(self, rid: str) -> bool:
        return self._loop.run_until_complete(self._client.abort(rid))

    def status(self, timeout: float = 5.0) -> cp.StatusReply:
        return self._loop.run_until_complete(self._client.status(timeout))
