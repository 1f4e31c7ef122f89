"""Any message a client can send gets one final reply, and the service keeps serving.

A bounded hypothesis fuzz of frame layouts and payloads against a real `runtime up`, plus
the known-nasty cases spelled out. Each message must get exactly one final reply (Done,
ProtocolError, StatusReply or AbortReply; chunks and pings are not final), and after each
one a second connection must get a StatusReply within 5 s.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from conftest import running_config, running_service
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.client import SyncClient
from runtime.protocol import client as cp

EXTRA = "[cache]\nkv_slots = 2048\n[scheduler]\nmax_running = 8\nmax_context = 128\n"
FUZZ_EXAMPLES = 400
STATUS_TIMEOUT_S = 5.0
FINAL_TIMEOUT_S = 20.0  # a queued 127-token generation, on a slow machine
FINAL = (cp.Done, cp.ProtocolError, cp.StatusReply, cp.AbortReply)

# ---- strategies ----------------------------------------------------------------------
FIELDS = [
    "type", "rid", "prompt", "token_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "logit_bias", "seed", "min_tokens", "stop", "logprobs", "top_logprobs", "ignore_eos", "stop_token_ids", "stream",
]
TYPES = ["generate", "abort", "status", "chunk", "chunks", "done", "status_reply", "ping", "", "GENERATE"]
EXTREME_INTS = [2**64 - 1, 2**63, 2**63 - 1, -(2**63), 2**31, -(2**31) - 1, 0, -1]
EXTREME_REALS = [0.0, -0.0, 1e-40, -1e-40, 1e-5, 0.5, 1.0, 2.0, 10.0, 1e4, 1e4 + 1, 1e308]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]

ints = st.integers(-(2**63), 2**64 - 1) | st.sampled_from(EXTREME_INTS)  # msgpack's whole int range
floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.none() | st.booleans() | ints | floats | st.text(max_size=40) | st.binary(max_size=40)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8) | st.integers(-3, 3), inner, max_size=6),
    max_leaves=40,
)
reals = st.sampled_from(EXTREME_REALS + NON_FINITE) | floats | ints | values
ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=100)

rids = (
    st.text(max_size=24)
    | st.sampled_from(["", "a", "x" * 256, "x" * 257, "é" * 256])
    | st.text(min_size=250, max_size=300)
    | scalars
)
token_ids = st.lists(st.integers(-5, 300), max_size=140) | st.lists(ints, max_size=4) | values
prompts = (
    ascii_text
    | st.text(max_size=200)
    | st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1030, max_size=1100)  # off the loop
    | st.just("a" * 70_000)  # over the prompt byte limit
    | values
)
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | values}), max_size=3
)
chat = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | st.text(max_size=10) | values},
        optional={
            "content": ascii_text | st.none() | content_parts | values,
            "name": st.text(max_size=8),
            "tool_calls": values,
        },
    ),
    max_size=4,
)
GENERATE_FIELDS = {
    "token_ids": token_ids,
    "prompt": prompts,
    "messages": chat | values,
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["tokenize", "messages", "documents", "enable_thinking"]) | st.text(max_size=8),
        values,
        max_size=3,
    )
    | values,
    "tools": st.lists(st.dictionaries(st.text(max_size=8), values, max_size=3), max_size=3) | values,
    "max_tokens": st.integers(-5, 40) | st.sampled_from(EXTREME_INTS) | values,
    "temperature": reals,
    "top_p": reals,
    "top_k": st.integers(-2, 300) | ints | values,
    "min_p": reals,
    "repetition_penalty": reals,
    "presence_penalty": reals,
    "frequency_penalty": reals,
    "logit_bias": st.dictionaries(st.integers(-5, 300) | ints, reals, max_size=5) | values,
    "seed": st.none() | ints | values,
    "min_tokens": st.integers(-5, 200) | st.sampled_from(EXTREME_INTS) | values,
    "stop": st.lists(st.text(max_size=6), max_size=4) | st.text(max_size=6) | values,
    "logprobs": st.booleans() | values,
    "top_logprobs": st.integers(-2, 25) | values,
    "ignore_eos": st.booleans() | values,
    "stop_token_ids": st.lists(st.integers(-5, 300) | ints, max_size=4) | values,
    "stream": st.booleans() | values,
}


# The same fields with values of the declared types only: these pass decoding and reach the
# service's own checks (ranges, vocabulary, context, chat template).
typed_reals = st.sampled_from(EXTREME_REALS + NON_FINITE) | floats | st.integers(-3, 3)
TYPED_GENERATE_FIELDS = {
    "token_ids": st.lists(st.integers(-5, 300), max_size=140) | st.lists(ints, max_size=4),
    "prompt": ascii_text | st.text(max_size=200),
    "messages": chat,
    "max_tokens": st.integers(-5, 40) | st.sampled_from(EXTREME_INTS),
    "temperature": typed_reals,
    "top_p": typed_reals,
    "top_k": st.integers(-2, 300) | ints,
    "min_p": typed_reals,
    "repetition_penalty": typed_reals,
    "presence_penalty": typed_reals,
    "frequency_penalty": typed_reals,
    "logit_bias": st.dictionaries(st.integers(-5, 300) | ints, typed_reals, max_size=5),
    "seed": st.none() | ints,
    "min_tokens": st.integers(-5, 200) | st.sampled_from(EXTREME_INTS),
    "stop": st.lists(st.text(max_size=6), max_size=20),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-2, 25),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-5, 300) | ints, max_size=4),
    "stream": st.booleans(),
}


def shaped(kind: str) -> st.SearchStrategy[dict]:
    """A dict shaped like a client message of ``kind``, with random and extreme field values."""
    optional = {"x": values}
    if kind == "generate":
        optional |= GENERATE_FIELDS
    required = {"type": st.just(kind) | st.sampled_from(TYPES), "rid": rids}
    return st.fixed_dictionaries(required, optional=optional)


typed_generate = st.fixed_dictionaries(
    {"type": st.just("generate"), "rid": st.text(max_size=12)}, optional=TYPED_GENERATE_FIELDS
)


@st.composite
def valid_generate(draw: st.DrawFn) -> cp.Generate:
    """A Generate the service should run: valid values across the sampling parameters."""
    if draw(st.integers(0, 4)) == 0:
        prompt = {"messages": [{"role": "user", "content": draw(st.text("abc xyz", min_size=1, max_size=30))}]}
    else:
        prompt = {"token_ids": draw(st.lists(st.integers(0, 255), min_size=1, max_size=20))}
    logprobs = draw(st.booleans())
    return cp.Generate(
        rid=draw(st.text(max_size=12)),
        **prompt,
        max_tokens=draw(st.integers(1, 40)),
        temperature=draw(st.sampled_from([0.0, 0.7, 1e-40, 1e4])),
        top_p=draw(st.sampled_from([1.0, 0.5, 1e-9])),
        top_k=draw(st.sampled_from([0, 1, 5, 10**9])),
        min_p=draw(st.sampled_from([0.0, 0.1, 1.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1e-3, 10.0])),
        presence_penalty=draw(st.sampled_from([0.0, -2.0, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, -2.0, 2.0])),
        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, 255), st.floats(-100, 100), max_size=4)),
        seed=draw(st.none() | st.integers(0, 2**64 - 1)),
        min_tokens=draw(st.integers(0, 50)),
        stop=draw(st.none() | st.lists(st.text("abc xyz", min_size=1, max_size=4), max_size=3)),
        logprobs=logprobs,
        top_logprobs=draw(st.integers(0, 20)) if logprobs else 0,
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, 255), max_size=3)),
        stream=draw(st.booleans()),
    )


valid = (
    valid_generate()
    | st.builds(cp.Abort, rid=st.text(max_size=12))
    | st.builds(cp.StatusQuery, rid=st.text(max_size=12))
).map(cp.client_encoder.encode)


def _flip(payload: bytes, at: int, byte: int) -> bytes:
    if not payload:
        return bytes([byte])
    at %= len(payload)
    return payload[:at] + bytes([byte]) + payload[at + 1 :]


deep = st.integers(1, 5000).flatmap(
    lambda n: st.sampled_from(
        [
            b"\x91" * n + b"\xc0",
            b"\x81\xa3rid" * n + b"\xc0",
            b"\x82\xa3rid\xa1x\xa1z" + b"\x91" * n + b"\xc0",
            b"\x83\xa4type\xa6status\xa3rid\xa1x\xa1z" + b"\x91" * n + b"\xc0",
        ]
    )
)
payloads = st.one_of(
    st.binary(max_size=200),
    values.map(msgspec.msgpack.encode),
    st.sampled_from(["generate", "abort", "status"]).flatmap(shaped).map(msgspec.msgpack.encode),
    typed_generate.map(msgspec.msgpack.encode),
    valid,
    valid.flatmap(lambda p: st.integers(0, len(p)).map(lambda cut: p[:cut])),  # truncated
    st.tuples(valid, st.integers(0, 10**6), st.integers(0, 255)).map(lambda t: _flip(*t)),  # one byte changed
    st.tuples(valid, st.binary(min_size=1, max_size=8)).map(lambda t: t[0] + t[1]),  # trailing bytes
    deep,
)
messages = st.one_of(
    payloads.map(lambda p: [p]),
    payloads.map(lambda p: [b"", p]),  # a REQ socket's envelope
    st.lists(payloads | st.just(b""), min_size=1, max_size=4),
)


# ---- sockets -------------------------------------------------------------------------
def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def recv_final(sock: zmq.Socket, timeout_s: float) -> cp.Done | cp.ProtocolError | cp.StatusReply | cp.AbortReply:
    """The next final reply on ``sock``, skipping chunks and pings; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0 and sock.poll(remaining * 1000), f"no final reply within {timeout_s} s"
        msg = cp.server_msg_decoder.decode(sock.recv_multipart()[-1])  # every reply must decode
        if isinstance(msg, FINAL):
            return msg


def quiet_for(sock: zmq.Socket, seconds: float) -> list:
    """Every final reply that arrives within ``seconds`` (there should be none)."""
    extra = []
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        if sock.poll(remaining * 1000):
            msg = cp.server_msg_decoder.decode(sock.recv_multipart()[-1])
            if isinstance(msg, FINAL):
                extra.append(msg)
    return extra


def check_status(sock: zmq.Socket, rid: str, timeout_s: float = STATUS_TIMEOUT_S) -> cp.StatusReply:
    """Ask for status on ``sock`` and wait (at most ``timeout_s``) for the reply with this rid."""
    sock.send(cp.client_encoder.encode(cp.StatusQuery(rid=rid)))
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        answered = remaining > 0 and sock.poll(remaining * 1000)
        assert answered, f"the service did not answer a status query within {timeout_s} s"
        msg = cp.server_msg_decoder.decode(sock.recv_multipart()[-1])
        if isinstance(msg, cp.StatusReply) and msg.rid == rid:
            return msg


def wait_idle(sock: zmq.Socket, timeout_s: float = 20.0) -> cp.StatusReply:
    """Status once nothing is running or waiting (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = check_status(sock, f"idle-{time.monotonic()}")
        if status.running == 0 and status.waiting == 0:
            return status
        assert time.monotonic() < deadline, f"requests still in the service: {status}"
        time.sleep(0.05)


def generate(sock: zmq.Socket, **fields) -> cp.Done:
    """Send a Generate built from ``fields`` (any values) and return its Done."""
    sock.send(msgspec.msgpack.encode({"type": "generate", **fields}))
    reply = recv_final(sock, FINAL_TIMEOUT_S)
    assert isinstance(reply, cp.Done), reply
    return reply


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("fuzz"), model_dir("llama"), EXTRA) as svc:
        yield svc


@pytest.fixture(scope="module")
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def assert_still_serving(svc, ctx: zmq.Context) -> None:
    """The process is alive, nothing is left running, no worker was lost, a Client is served."""
    assert svc.proc.poll() is None, "the service exited:\n" + svc.log()
    assert "error handling a client message" not in svc.log(), svc.log()
    probe = dealer(ctx, svc.address)
    try:
        status = wait_idle(probe)
    finally:
        probe.close()
    assert status.worker_restarts == 0, "a client message cost a worker"
    with SyncClient(svc.address, timeout_s=30) as client:
        result = client.generate(token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 8


# ---- tests ---------------------------------------------------------------------------
def test_fuzzed_messages_each_get_one_reply(served, ctx):
    """Each random message gets one final reply and a status query on another connection is
    answered after it; at the end no reply is left over and the service serves normally."""
    fuzz, status_sock = dealer(ctx, served.address), dealer(ctx, served.address)
    counts = {"sent": 0}

    # database=None: no .hypothesis folder in the repo; a failure prints its example.
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(frames=messages)
    def one_message(frames: list[bytes]) -> None:
        fuzz.send_multipart(frames)
        counts["sent"] += 1
        recv_final(fuzz, FINAL_TIMEOUT_S)
        check_status(status_sock, f"fuzz-status-{counts['sent']}")

    try:
        one_message()
        assert quiet_for(fuzz, 0.5) == [], "a message got more than one final reply"
    finally:
        fuzz.close()
        status_sock.close()
    assert counts["sent"] >= FUZZ_EXAMPLES // 2
    assert_still_serving(served, ctx)


def test_known_nasty_messages(served, ctx):
    """Frame layouts, nesting, rids and temperatures that broke or could break a decoder."""
    sock = dealer(ctx, served.address)
    try:
        # Two frames: neither DEALER's nor REQ's layout.
        sock.send_multipart([cp.client_encoder.encode(cp.StatusQuery(rid="two")), b"x"])
        reply = recv_final(sock, STATUS_TIMEOUT_S)
        assert isinstance(reply, cp.ProtocolError) and "frames" in reply.message
        # An empty frame, and nothing at all in a REQ envelope.
        for frames in ([b""], [b"", b""]):
            sock.send_multipart(frames)
            assert isinstance(recv_final(sock, STATUS_TIMEOUT_S), cp.ProtocolError)
        # Deep nesting: 3 KB of fixarray headers; a known rid next to a deeply nested value.
        sock.send(b"\x91" * 3000 + b"\xc0")
        assert isinstance(recv_final(sock, STATUS_TIMEOUT_S), cp.ProtocolError)
        sock.send(b"\x82\xa3rid\xa4deep\xa1z" + b"\x91" * 3000 + b"\xc0")
        assert isinstance(recv_final(sock, STATUS_TIMEOUT_S), cp.ProtocolError)
        sock.send(b"\x82\xa1z" + b"\x91" * 3000 + b"\xc0" + b"\xa3rid\xa4deep")
        assert isinstance(recv_final(sock, STATUS_TIMEOUT_S), cp.ProtocolError)
        # A 300-character rid is refused, and not echoed back.
        sock.send(msgspec.msgpack.encode({"type": "status", "rid": "r" * 300}))
        reply = recv_final(sock, STATUS_TIMEOUT_S)
        assert isinstance(reply, cp.ProtocolError) and reply.rid == ""
        # Temperatures: NaN and inf are refused; 1e-40 is greedy.
        for i, temperature in enumerate([float("nan"), float("inf"), float("-inf")]):
            done = generate(sock, rid=f"t{i}", token_ids=[5, 6, 7], max_tokens=5, temperature=temperature)
            assert done.finish_reason == "error" and "temperature" in done.error
        tiny = generate(sock, rid="tiny", token_ids=[9, 4, 7, 2], max_tokens=24, temperature=1e-40, ignore_eos=True)
        greedy = generate(sock, rid="greedy", token_ids=[9, 4, 7, 2], max_tokens=24, temperature=0.0, ignore_eos=True)
        assert tiny.finish_reason == "length" and len(tiny.token_ids) == 24
        assert tiny.token_ids == greedy.token_ids
    finally:
        sock.close()

    assert_still_serving(served, ctx)


def test_req_socket_gets_exactly_one_reply(served, ctx):
    """A REQ socket takes one reply per request: the Done, never chunks or pings.

    Five requests of 120 tokens keep a request in flight across several ping rounds (0.25 s).
    """
    dealer_sock = dealer(ctx, served.address)
    try:
        expected = generate(dealer_sock, rid="ref", token_ids=[9, 4, 7, 2], max_tokens=120, ignore_eos=True)
    finally:
        dealer_sock.close()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(served.address)
    try:
        for i in range(5):
            msg = cp.Generate(rid=f"req{i}", token_ids=[9, 4, 7, 2], max_tokens=120, ignore_eos=True, stream=True)
            req.send(cp.client_encoder.encode(msg))
            assert req.poll(10_000), f"request {i} of a REQ socket got no reply"
            done = cp.server_msg_decoder.decode(req.recv())
            assert isinstance(done, cp.Done) and done.rid == f"req{i}" and done.token_ids == expected.token_ids
        req.send(cp.client_encoder.encode(cp.StatusQuery(rid="req-status")))  # the next reply is this one's
        assert req.poll(STATUS_TIMEOUT_S * 1000)
        status = cp.server_msg_decoder.decode(req.recv())
        assert isinstance(status, cp.StatusReply) and status.rid == "req-status"
    finally:
        req.close()
    assert_still_serving(served, ctx)


def test_chat_text_outside_content_does_not_stall_others(served, ctx):
    """A chat request is as big as all the text its template renders, not only its "content":
    a 3 MB role must be refused or rendered off the event loop while others are answered."""
    big, other = dealer(ctx, served.address), dealer(ctx, served.address)
    try:
        check_status(other, "chat-before")
        big.send(msgspec.msgpack.encode({"type": "generate", "rid": "big", "messages": [{"role": "r" * 3_000_000}]}))
        deadline = time.monotonic() + 60
        n = 0
        while not big.poll(0):
            assert time.monotonic() < deadline, "no reply to the big chat request"
            n += 1
            check_status(other, f"chat-{n}", timeout_s=1.0)
        done = recv_final(big, FINAL_TIMEOUT_S)
        assert isinstance(done, cp.Done) and done.finish_reason == "error"
    finally:
        big.close()
        other.close()
    assert_still_serving(served, ctx)


def test_oversized_message_drops_only_that_connection(model_dir, tmp_path, ctx):
    """Past server.max_message_mb ZeroMQ closes the sender's connection; others are served."""
    config_file = tmp_path / "service.toml"
    config_file.write_text(
        f'[model]\npath = "{model_dir("llama")}"\n[server]\naddress = "ipc://"\nmax_message_mb = 1\n{EXTRA}'
    )
    with running_config(config_file) as svc:
        big, other = dealer(ctx, svc.address), dealer(ctx, svc.address)
        events = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            check_status(other, "before")
            big.send(msgspec.msgpack.encode({"type": "status", "rid": "big", "pad": b"\0" * (3 * 2**19)}))
            assert events.poll(STATUS_TIMEOUT_S * 1000), "the service kept the connection"
            assert quiet_for(big, 0.5) == [], "an oversized message was answered"
            done = generate(other, rid="after", token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
            assert done.finish_reason == "length" and len(done.token_ids) == 8
        finally:
            big.disable_monitor()
            events.close()
            big.close()
            other.close()
        assert_still_serving(svc, ctx)
