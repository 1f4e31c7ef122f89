"""ZeroMQ client for the runtime: async (``Client``) and synchronous (``SyncClient``)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq

from runtime.protocol import client as cp
from runtime.protocol.loop_socket import LoopSocket
from runtime.protocol.security import secure_client


class ServiceUnavailable(ConnectionError):
    """Nothing answered at the address in time."""


class RequestFailed(RuntimeError):
    """The service rejected a request or could not finish it; ``result`` has the details."""

    def __init__(self, result: GenerationResult) -> None:
        super().__init__(result.error or result.finish_reason)
        self.result = result


SAMPLING_KEYWORDS = frozenset(
    {
        "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "logit_bias", "seed", "min_tokens", "stop", "logprobs", "top_logprobs", "prompt_logprobs",
        "json_schema", "regex", "grammar", "json_object",
    }
)
"""Keywords ``generate``/``stream``/``chat`` take besides the named ones (see the README's table)."""


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the ``top`` (token id, logprob) pairs, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """New tokens of a streaming request, the text they completed, and their logprobs if asked."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    """A finished request. ``finish_reason`` is "stop", "length", "abort" or "error";
    ``stop_reason`` the stop string or stop token id that ended it (None for EOS); ``queue_s``
    the seconds it waited in the scheduler before its admission (None if never admitted)."""

    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    queue_s: float | None = None
    prompt_token_ids: list[int] | None = None  # with ``prompt_logprobs``: the prompt as run ...
    prompt_logprobs: list[TokenLogprob] | None = None  # ... and each token's after the first


def _logprobs(entries: list[cp.TokenLogprob] | None) -> list[TokenLogprob] | None:
    if entries is None:
        return None
    return [TokenLogprob(e.token_id, e.logprob, [tuple(pair) for pair in e.top]) for e in entries]


def _result(done: cp.Done) -> GenerationResult:
    return GenerationResult(
        rid=done.rid,
        token_ids=list(done.token_ids),
        text=done.text,
        finish_reason=done.finish_reason,
        prompt_tokens=done.prompt_tokens,
        cached_tokens=done.cached_tokens,
        error=done.error,
        logprobs=_logprobs(done.logprobs),
        stop_reason=done.stop_reason,
        queue_s=done.queue_s,
        prompt_token_ids=list(done.prompt_ids) if done.prompt_ids is not None else None,
        prompt_logprobs=_logprobs(done.prompt_logprobs),
    )


class Client:
    """Async client: ``async with Client(address) as c: await c.generate(prompt="...")``.

    One DEALER socket; a background task routes replies to waiting requests by id. Request
    ids belong to this connection. A request whose caller stops waiting (a cancelled
    ``generate``, a stream left early or closed) is aborted. With ``server_key`` (the
    service's CURVE public key, Z85) the connection is encrypted; ``public_key`` and
    ``secret_key`` are this client's own key pair (a fresh one when both are None).
    """

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        *,
        server_key: str | None = None,
        public_key: str | None = None,
        secret_key: str | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._keys = (server_key, public_key, secret_key)
        self._ctx: zmq.Context | None = None
        self._sock: LoopSocket | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> Client:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, *self._keys)
        sock.connect(self.address)
        self._sock = LoopSocket(sock)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = self._reader = None

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            payload = await self._sock.recv()
            assert payload is not None  # no timeout: only a message ends the wait
            msg = cp.server_msg_decoder.decode(payload)
            if isinstance(msg, cp.Ping):
                continue
            for item in msg.chunks if isinstance(msg, cp.ChunkBatch) else (msg,):
                key = "abort:" + item.rid if isinstance(item, cp.AbortReply) else item.rid
                queue = self._queues.get(key)
                if queue is not None:
                    queue.put_nowait(item)

    def _abandon(self, rid: str) -> None:
        """The caller stopped waiting for ``rid``: abort it without waiting for the answer."""
        self._queues.pop(rid, None)
        if self._sock is not None:
            try:
                self._sock.send(cp.client_encoder.encode(cp.Abort(rid=rid)))
            except zmq.ZMQError:
                pass  # a full or closed socket: the service aborts it when this connection goes

    async def _call(self, msg: msgspec.Struct, rid: str) -> asyncio.Queue:
        assert self._sock is not None, "use `async with Client(...)`"
        if len(rid) > cp.MAX_RID_LEN + len("abort:"):
            raise ValueError(f"request ids are at most {cp.MAX_RID_LEN} characters")
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is in use on this connection")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            self._sock.send(cp.client_encoder.encode(msg))
        except zmq.Again:
            # A full send queue: the service has not read a thousand messages.
            self._queues.pop(rid, None)
            raise ServiceUnavailable(f"the service at {self.address} is not taking requests") from None
        return queue

    async def _get(self, queue: asyncio.Queue, timeout: float | None = None):
        if not queue.empty():
            return queue.get_nowait()
        limit = timeout if timeout is not None else self.timeout_s
        if limit is None:
            return await queue.get()
        try:
            async with asyncio.timeout(limit):  # no task per wait, as wait_for makes before 3.12
                return await queue.get()
        except TimeoutError:
            raise ServiceUnavailable(f"no reply from {self.address} within {limit} s") from None

    @staticmethod
    def _request(rid: str | None, stream: bool, sampling: dict, **fields) -> cp.Generate:
        unknown = set(sampling) - SAMPLING_KEYWORDS
        if unknown:
            raise TypeError(f"unknown keyword arguments {sorted(unknown)}; known: {sorted(SAMPLING_KEYWORDS)}")
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]
        if fields.get("token_ids") is not None:
            fields["token_ids"] = list(fields["token_ids"])
        fields["stop_token_ids"] = list(fields.get("stop_token_ids") or [])
        return cp.Generate(rid=rid or uuid.uuid4().hex, stream=stream, **fields, **sampling)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        stop_token_ids: list[int] | None = None,
        rid: str | None = None,
        **sampling,
    ) -> GenerationResult:
        """Run one request to completion; finish_reason "error" comes back as a result, not raised.

        ``sampling``: top_p, top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias ({token_id: bias}), seed, min_tokens, stop (a string or
        a list), logprobs, top_logprobs.
        """
        msg = self._request(rid, False, sampling, prompt=prompt, token_ids=token_ids, max_tokens=max_tokens,
                            temperature=temperature, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
        return await self._run(msg)

    async def chat(
        self,
        messages: list[dict],
        *,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        stop_token_ids: list[int] | None = None,
        rid: str | None = None,
        **sampling,
    ) -> GenerationResult:
        """``generate`` on the model's chat template applied to ``messages`` (with the generation prompt)."""
        msg = self._request(rid, False, sampling, messages=messages, chat_template_kwargs=chat_template_kwargs,
                            tools=tools, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                            stop_token_ids=stop_token_ids)
        return await self._run(msg)

    async def _run(self, msg: cp.Generate) -> GenerationResult:
        queue = await self._call(msg, msg.rid)
        finished = False
        try:
            while True:
                reply = await self._get(queue)
                if isinstance(reply, cp.Done):
                    finished = True
                    return _result(reply)
                if isinstance(reply, cp.ProtocolError):
                    finished = True
                    return GenerationResult(rid=msg.rid, finish_reason="error", error=reply.message)
        finally:
            if finished:
                self._queues.pop(msg.rid, None)
            else:
                self._abandon(msg.rid)  # cancelled or timed out: nobody wants the rest

    def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        stop_token_ids: list[int] | None = None,
        rid: str | None = None,
        **sampling,
    ) -> Stream:
        """An async iterator of chunks as tokens are produced; raises RequestFailed if the
        request errors. After the last chunk, ``.result`` holds the final GenerationResult.
        Takes ``messages=`` (chat) instead of a prompt, and the sampling keywords of ``generate``."""
        msg = self._request(rid, True, sampling, prompt=prompt, token_ids=token_ids, messages=messages,
                            chat_template_kwargs=chat_template_kwargs, tools=tools, max_tokens=max_tokens,
                            temperature=temperature, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
        return Stream(self, msg)

    async def abort(self, rid: str) -> bool:
        """End a waiting or running request; False if no such request was known."""
        queue = await self._call(cp.Abort(rid=rid), "abort:" + rid)
        try:
            while True:
                reply = await self._get(queue, timeout=self.timeout_s or 10.0)
                if isinstance(reply, cp.AbortReply):
                    return reply.found
        finally:
            self._queues.pop("abort:" + rid, None)

    async def status(self, timeout: float = 5.0) -> cp.StatusReply:
        """Model and queue facts; raises ServiceUnavailable when nothing answers."""
        rid = "status:" + uuid.uuid4().hex
        queue = await self._call(cp.StatusQuery(rid=rid), rid)
        try:
            return await self._get(queue, timeout=timeout)
        finally:
            self._queues.pop(rid, None)


class Stream:
    """One streaming request: ``async for chunk in stream``; then ``stream.result``."""

    def __init__(self, client: Client, msg: cp.Generate) -> None:
        self._client = client
        self._msg = msg
        self._queue: asyncio.Queue | None = None
        self.rid = msg.rid
        self.result: GenerationResult | None = None

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self.result is not None:
            raise StopAsyncIteration
        if self._queue is None:
            self._queue = await self._client._call(self._msg, self.rid)
        while True:
            try:
                reply = await self._client._get(self._queue)
            except BaseException:
                self._client._abandon(self.rid)
                self.result = GenerationResult(rid=self.rid, finish_reason="abort", error="abandoned by the caller")
                raise
            if isinstance(reply, cp.Chunk):
                return GenerationChunk(token_ids=list(reply.token_ids), text=reply.text,
                                       logprobs=_logprobs(reply.logprobs))
            if isinstance(reply, cp.Done):
                self.result = _result(reply)
            elif isinstance(reply, cp.ProtocolError):
                self.result = GenerationResult(rid=self.rid, finish_reason="error", error=reply.message)
            else:
                continue
            self._client._queues.pop(self.rid, None)
            if self.result.finish_reason == "error":
                raise RequestFailed(self.result)
            raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop listening; a request still running is aborted."""
        if self._queue is not None and self.result is None:
            self._client._abandon(self.rid)
            self.result = GenerationResult(rid=self.rid, finish_reason="abort", error="closed by the caller")

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
