"""Reliability figures of a real `runtime up` under hostile clients and worker faults.

    python scripts/reliability.py                              # print the table
    python scripts/reliability.py --write docs/RELIABILITY.md  # and write the doc

Builds a tiny random-weight llama (tests/model_factory.py), starts one service per scenario
(`python -m runtime.cli up`, its own process group, always killed at the end) and drives it
with raw ZeroMQ sockets: a protocol fuzz (also while the worker starts), clients that disconnect mid-stream, a killed, a
stopped and a twice-killed worker, request floods, and clients that read slowly or never.
``--scale`` multiplies the message and request counts (1.0: about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import running_config, start_runtime, stop_runtime, worker_pid  # noqa: E402  (tests/ helpers: a real service, torn down)
from model_factory import make_model  # noqa: E402

from runtime.protocol import client as cp  # noqa: E402

FINAL = (cp.Done, cp.ProtocolError, cp.StatusReply, cp.AbortReply)
STATUS_TIMEOUT_S = 5.0


@dataclass
class Row:
    """One line of the table: what was measured, the figure, how."""

    scenario: str
    figure: str
    value: str
    how: str


# ---- sockets and the service ---------------------------------------------------------
class Probe:
    """A DEALER for status queries, plus the scheduler process (RSS, liveness)."""

    def __init__(self, ctx: zmq.Context, address: str, proc: subprocess.Popen) -> None:
        self.sock = dealer(ctx, address)
        self.proc = proc
        self._n = 0

    def status(self, timeout_s: float = STATUS_TIMEOUT_S) -> cp.StatusReply | None:
        """The service's status, or None when it does not answer within ``timeout_s``."""
        self._n += 1
        rid = f"probe-{self._n}"
        self.sock.send(cp.client_encoder.encode(cp.StatusQuery(rid=rid)))
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0 and self.sock.poll(remaining * 1000):
            msg = decode(self.sock.recv_multipart()[-1])
            if isinstance(msg, cp.StatusReply) and msg.rid == rid:
                return msg
        return None

    def rss_mib(self) -> float:
        """The scheduler's (the `runtime up` process's) resident memory."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


def dealer(ctx: zmq.Context, address: str, **options: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def decode(payload: bytes):
    return cp.server_msg_decoder.decode(payload)


def gen(rid: str, token_ids: list[int], max_tokens: int, stream: bool = False) -> bytes:
    msg = cp.Generate(rid=rid, token_ids=token_ids, max_tokens=max_tokens, ignore_eos=True, stream=stream)
    return cp.client_encoder.encode(msg)


def tokens_by_rid(msg) -> list[tuple[str, int]]:
    chunks = msg.chunks if isinstance(msg, cp.ChunkBatch) else [msg] if isinstance(msg, cp.Chunk) else []
    return [(c.rid, len(c.token_ids)) for c in chunks]


@contextmanager
def service(
    work: Path, name: str, folder: Path, extra: str, server: str = ""
) -> Iterator[tuple[object, Probe, zmq.Context]]:
    """A fresh `runtime up` with ``extra`` TOML (``server``: more [server] keys), a status probe
    and a context; all torn down."""
    config_file = work / f"{name}.toml"
    config_file.write_text(f'[model]\npath = "{folder}"\n[server]\naddress = "ipc://"\n{server}\n{extra}\n')
    ctx = zmq.Context()
    try:
        with running_config(config_file) as svc:
            probe = Probe(ctx, svc.address, svc.proc)
            try:
                yield svc, probe, ctx
            finally:
                probe.sock.close()
    finally:
        ctx.destroy(linger=0)


# ---- the fuzz's messages (the generators of tests/test_protocol_fuzz.py, on plain random) ----
FIELDS = [
    "type", "rid", "prompt", "token_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "logit_bias", "seed", "min_tokens", "stop", "logprobs", "top_logprobs", "ignore_eos", "stop_token_ids", "stream",
]
TYPES = ["generate", "abort", "status", "chunk", "chunks", "done", "status_reply", "ping", "", "GENERATE"]
EXTREME_INTS = [2**64 - 1, 2**63, 2**63 - 1, -(2**63), 2**31, -(2**31) - 1, 0, -1]
EXTREME_FLOATS = [0.0, -0.0, 1e-40, 1e-5, 0.7, 1e4, 1e4 + 1, 1e308, float("nan"), float("inf"), float("-inf")]


class Fuzzer:
    """Random client messages: frame layouts, bytes, msgpack values, message-shaped maps."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.recent: deque[str] = deque(maxlen=64)  # rids sent lately: Aborts aim at them
        self._n = 0

    def text(self, n: int) -> str:
        pool = "abcxyz 0123456789é€\u0000\U0001f600" if self.rng.random() < 0.3 else "abcdefgh ijkl"
        return "".join(self.rng.choice(pool) for _ in range(n))

    def scalar(self):
        r = self.rng
        return r.choice([
            None, r.random() < 0.5, r.choice(EXTREME_INTS), r.randint(-(2**63), 2**64 - 1), r.randint(-5, 300),
            r.choice(EXTREME_FLOATS), r.uniform(-1e6, 1e6), self.text(r.randint(0, 40)), r.randbytes(r.randint(0, 40)),
        ])

    def value(self, depth: int = 0):
        r = self.rng
        if depth > 3 or r.random() < 0.5:
            return self.scalar()
        if r.random() < 0.5:
            return [self.value(depth + 1) for _ in range(r.randint(0, 6))]
        keys = [r.choice(FIELDS) if r.random() < 0.5 else self.text(r.randint(0, 8)) for _ in range(r.randint(0, 6))]
        return {k: self.value(depth + 1) for k in keys}

    def pick(self, good: Callable[[], object], *weird: object):
        """Mostly a sensible value, sometimes an extreme one, sometimes any value at all."""
        x = self.rng.random()
        return good() if x < 0.6 else self.rng.choice(weird) if weird and x < 0.85 else self.value()

    def rid(self):
        self._n += 1
        return self.pick(lambda: f"z{self._n}", "", "x" * 256, "x" * 257, "é" * 256, self.text(300))

    def shaped(self) -> dict:
        """A message-shaped map; ``typed`` ones have values of the declared types only (they pass
        decoding and reach the service's own checks)."""
        r = self.rng
        kind = r.choice(["generate", "generate", "generate", "abort", "status"])
        typed = r.random() < 0.5
        tag = kind if typed or r.random() < 0.8 else r.choice(TYPES)
        msg = {"type": tag, "rid": f"t{self._n}" if typed else self.rid()}

        def typed_pick(good: Callable[[], object], *weird: object):
            return good() if r.random() < 0.7 or not weird else r.choice(weird)

        pick = typed_pick if typed else self.pick
        real = lambda: pick(lambda: r.choice(EXTREME_FLOATS), r.randint(-3, 3), r.uniform(-1e3, 1e3))  # noqa: E731
        if kind == "generate":
            fields = {
                "token_ids": lambda: pick(lambda: [r.randint(-5, 300) for _ in range(r.randint(0, 140))],
                                          [], [2**64 - 1], [-(2**63)]),
                "prompt": lambda: pick(lambda: self.text(r.randint(0, 100)), "", "a" * 1100, "a" * 70_000),
                "messages": lambda: pick(
                    lambda: [self.chat_message() for _ in range(r.randint(0, 4))], [], [{"role": "u"}] * 100
                ),
                "max_tokens": lambda: pick(lambda: r.randint(-5, 40), *EXTREME_INTS),
                "temperature": real, "top_p": real, "min_p": real, "repetition_penalty": real,
                "presence_penalty": real, "frequency_penalty": real,
                "top_k": lambda: pick(lambda: r.randint(-2, 300), *EXTREME_INTS),
                "logit_bias": lambda: pick(
                    lambda: {r.randint(-5, 300): real() for _ in range(r.randint(0, 5))}, {2**64 - 1: 1.0}
                ),
                "seed": lambda: pick(lambda: r.choice([None, 0, 2**64 - 1, r.randint(0, 2**64 - 1)]), -1),
                "min_tokens": lambda: pick(lambda: r.randint(-5, 200), *EXTREME_INTS),
                "stop": lambda: pick(
                    lambda: [self.text(r.randint(0, 6)) for _ in range(r.randint(0, 20))], ["x" * 300]
                ),
                "logprobs": lambda: pick(lambda: r.random() < 0.5),
                "top_logprobs": lambda: pick(lambda: r.randint(-2, 25)),
                "ignore_eos": lambda: pick(lambda: r.random() < 0.5),
                "stop_token_ids": lambda: pick(lambda: [r.randint(-5, 300)], [2**64 - 1]),
                "stream": lambda: pick(lambda: r.random() < 0.5),
            }
            for key, make in fields.items():
                if r.random() < (0.15 if key in ("prompt", "messages") else 0.3):
                    msg[key] = make()
        if not typed and r.random() < 0.1:
            msg[self.text(3)] = self.value()
        return msg

    def chat_message(self) -> dict:
        r = self.rng
        message = {"role": self.pick(lambda: r.choice(["user", "assistant", "system", "tool"]))}
        if r.random() < 0.8:
            message["content"] = self.pick(lambda: self.text(r.randint(0, 40)), None, [{"type": "text", "text": "hi"}])
        return message

    def valid(self) -> bytes:
        r = self.rng
        x = r.random()
        if x < 0.7:
            self._n += 1
            rid = f"v{self._n}"
            self.recent.append(rid)
            if r.random() < 0.2:
                prompt = {"messages": [{"role": "user", "content": self.text(r.randint(1, 30))}]}
            else:
                prompt = {"token_ids": [r.randint(0, 255) for _ in range(r.randint(1, 20))]}
            logprobs = r.random() < 0.3
            msg = cp.Generate(
                rid=rid, **prompt, max_tokens=r.randint(1, 40),
                temperature=r.choice([0.0, 0.7, 1e-40, 1e4]), top_p=r.choice([1.0, 0.5, 1e-9]),
                top_k=r.choice([0, 1, 5, 10**9]), min_p=r.choice([0.0, 0.1, 1.0]),
                repetition_penalty=r.choice([1.0, 1e-3, 10.0]), presence_penalty=r.choice([0.0, -2.0, 2.0]),
                frequency_penalty=r.choice([0.0, -2.0, 2.0]),
                logit_bias={r.randint(0, 255): r.uniform(-100, 100) for _ in range(r.randint(0, 4))} or None,
                seed=r.choice([None, r.randint(0, 2**64 - 1)]), min_tokens=r.randint(0, 50),
                stop=[self.text(r.randint(1, 4)) for _ in range(r.randint(0, 3))] or None,
                logprobs=logprobs, top_logprobs=r.randint(0, 20) if logprobs else 0,
                ignore_eos=r.random() < 0.5, stop_token_ids=[r.randint(0, 255) for _ in range(r.randint(0, 3))],
                stream=r.random() < 0.5,
            )
        elif x < 0.9 and self.recent:
            msg = cp.Abort(rid=r.choice(self.recent))
        else:
            msg = cp.StatusQuery(rid=f"s{self._n}")
        return cp.client_encoder.encode(msg)

    def payload(self) -> bytes:
        r = self.rng
        kind = r.randrange(8)
        if kind == 0:
            return r.randbytes(r.randint(0, 200))
        if kind == 1:
            return encode_any(self.value())
        if kind == 2:
            return encode_any(self.shaped())
        if kind == 3:
            return self.valid()
        good = self.valid()
        if kind == 4:
            return good[: r.randint(0, len(good))]
        if kind == 5:
            at = r.randrange(len(good))
            return good[:at] + bytes([r.randrange(256)]) + good[at + 1 :]
        if kind == 6:
            return good + r.randbytes(r.randint(1, 8))
        n = r.randint(1, 5000)
        deep = b"\x91" * n + b"\xc0"
        return r.choice([deep, b"\x81\xa3rid" * n + b"\xc0", b"\x82\xa3rid\xa1x\xa1z" + deep])

    def message(self) -> list[bytes]:
        r = self.rng
        x = r.random()
        if x < 0.6:
            return [self.payload()]
        if x < 0.8:
            return [b"", self.payload()]  # a REQ socket's envelope
        return [self.payload() if r.random() < 0.8 else b"" for _ in range(r.randint(1, 4))]


def encode_any(value: object) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except Exception:  # a value msgpack cannot hold: send its repr instead
        return msgspec.msgpack.encode(repr(value).encode("utf-8", "surrogatepass"))


# ---- scenarios -----------------------------------------------------------------------
def fuzz(work: Path, folder: Path, count: int) -> list[Row]:
    extra = "[cache]\nkv_slots = 2048\n[scheduler]\nmax_running = 8\nmax_context = 128\n"
    fz = Fuzzer(seed=1)
    sent = finals = hangs = 0
    crashed = False
    with service(work, "fuzz", folder, extra) as (svc, probe, ctx):
        start = time.monotonic()
        sock = dealer(ctx, svc.address, SNDHWM=0, RCVHWM=0)

        def drain(wait_ms: float = 0) -> None:
            nonlocal finals
            while sock.poll(wait_ms):
                finals += isinstance(decode(sock.recv_multipart()[-1]), FINAL)
                wait_ms = 0

        while sent < count and not crashed:
            sock.send_multipart(fz.message())
            sent += 1
            drain()
            blocked_since = time.monotonic()
            while sent - finals > 1000 and time.monotonic() - blocked_since < 30:  # stay under max_waiting
                drain(10)
            if sent % 50 == 0:
                hangs += probe.status() is None
                crashed = svc.proc.poll() is not None
        deadline = time.monotonic() + 60
        while finals < sent and time.monotonic() < deadline and not crashed:
            drain(100)
        drain(500)  # a second final reply to any message would arrive now
        elapsed = time.monotonic() - start
        crashed = crashed or svc.proc.poll() is not None
        status = probe.status()
        bugs = svc.log().count("error handling a client message")
        sock.close()
    restarts = status.worker_restarts if status is not None else "?"
    how = f"{sent:,} seeded random messages (frames, bytes, msgpack, message-shaped maps, deep nesting) from one DEALER"
    return [
        Row("fuzz", "messages sent / final replies", f"{sent:,} / {finals:,}",
            how + "; one final reply each is expected"),
        Row("fuzz", "crashes / hangs / worker restarts", f"{int(crashed)} / {hangs} / {restarts}",
            "service process exited; status unanswered within 5 s (asked every 50 messages)"),
        Row("fuzz", "handler errors logged", str(bugs), "'error handling a client message' lines in the service log"),
        Row("fuzz", "time", f"{elapsed:.1f} s ({sent / elapsed:,.0f} msg/s)", "including the generations it started"),
    ]


def startup_fuzz(work: Path, folder: Path, count: int) -> list[Row]:
    """The fuzz's messages while the worker is still starting (frozen with SIGSTOP meanwhile)."""
    address = f"ipc://{work}/startup.sock"
    config_file = work / "startup.toml"
    config_file.write_text(f'[model]\npath = "{folder}"\n[server]\naddress = "{address}"\n'
                           "[cache]\nkv_slots = 2048\n[scheduler]\nmax_running = 8\nmax_context = 128\n")
    fz = Fuzzer(seed=2)
    ctx = zmq.Context()
    proc, _, lines = start_runtime(config_file)
    sent = finals = early = statuses = answered = 0
    try:
        worker = worker_pid(proc)
        os.kill(worker, signal.SIGSTOP)
        probe = Probe(ctx, address, proc)
        sock = dealer(ctx, address, SNDHWM=0, RCVHWM=0)

        def drain(wait_ms: float = 0) -> None:
            nonlocal finals
            while sock.poll(wait_ms):
                finals += isinstance(decode(sock.recv_multipart()[-1]), FINAL)
                wait_ms = 0

        try:
            while sent < count:
                sock.send_multipart(fz.message())
                sent += 1
                drain()
                if sent % 100 == 0:
                    statuses += 1
                    reply = probe.status()
                    answered += reply is not None and reply.worker_state == "starting"
            drain(500)
            early = finals
        finally:
            os.kill(worker, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while finals < sent and time.monotonic() < deadline and proc.poll() is None:
            drain(100)
        drain(500)  # a second final reply to any message would arrive now
        status = probe.status()
        crashed = proc.poll() is not None
        bugs = "".join(lines).count("error handling a client message")
        sock.close()
        probe.sock.close()
    finally:
        stop_runtime(proc)
        ctx.destroy(linger=0)
    state = status.worker_state if status is not None else "no answer"
    return [
        Row("fuzz while starting", "messages sent / final replies (before the worker was ready)",
            f"{sent:,} / {finals:,} ({early:,})",
            f"{sent:,} seeded fuzz messages from one DEALER while the worker is frozen (SIGSTOP) in its start-up, "
            "then let go; requests wait for it, everything else is answered at once"),
        Row("fuzz while starting", "status answered 'starting' / asked", f"{answered} / {statuses}",
            "a status query every 100 messages while frozen, 5 s timeout"),
        Row("fuzz while starting", "crashes / handler errors / state after", f"{int(crashed)} / {bugs} / {state}",
            "service process exited; 'error handling a client message' lines; worker_state once let go"),
    ]


def disconnects(work: Path, folder: Path, clients: int) -> list[Row]:
    extra = f"[cache]\nenabled = false\nkv_slots = {clients * 520}\n[scheduler]\nmax_running = 64\nmax_context = 1024\n"
    with service(work, "disconnects", folder, extra) as (svc, probe, ctx):
        idle = probe.status()
        assert idle is not None
        socks = [dealer(ctx, svc.address) for _ in range(clients)]
        for i, sock in enumerate(socks):
            sock.send(gen(f"d{i}", [5 + i % 200, 6, 7], 500, stream=True))
        seen = [0] * clients
        open_socks = dict(enumerate(socks))
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + 60
        while open_socks and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                i = socks.index(sock)
                for _, n in tokens_by_rid(decode(sock.recv())):
                    seen[i] += n
                if seen[i] >= 3:
                    poller.unregister(sock)
                    sock.close()
                    del open_socks[i]
        closed_at = time.monotonic()
        trace = []
        unanswered = 0
        while time.monotonic() - closed_at < 15:
            status = probe.status()
            unanswered += status is None
            if status is not None:
                trace.append((time.monotonic() - closed_at, status.running, status.kv_slots_free))
                idle_again = status.running == 0 and status.kv_slots_free == idle.kv_slots_free
                if time.monotonic() - closed_at > 2.2 and idle_again:
                    break
            time.sleep(0.02)
    at_2s = next((running for t, running, _ in trace if t >= 2.0), None)
    back = next((t for t, running, free in trace if running == 0 and free == idle.kv_slots_free), None)
    how = f"{clients} DEALERs each stream a 500-token request, read 3 tokens, close the socket"
    return [
        Row("disconnects", "requests still running 2 s after the last close",
            str(at_2s) if at_2s is not None else "no status answer", how),
        Row("disconnects", "time until running == 0 and kv_slots_free is back to idle",
            f"{back:.2f} s" if back is not None else "not seen within 15 s",
            f"status polled every 20 ms from the last close; idle kv_slots_free = {idle.kv_slots_free} (cache off)"),
        Row("disconnects", "status queries unanswered", str(unanswered),
            "from another DEALER, 5 s timeout each, in the 15 s after the last close"),
    ]


def _stream_then(
    svc, probe: Probe, ctx: zmq.Context, n: int, fault: Callable[[int], None], reason: str
) -> tuple[float, list[float]]:
    """Start ``n`` streams, apply ``fault(worker_pid)`` once all stream: when, and seconds from it
    to each error reply (each must name ``reason``)."""
    status = probe.status()
    assert status is not None
    sock = dealer(ctx, svc.address)
    for i in range(n):
        sock.send(gen(f"k{i}", [5 + i, 6, 7], 800, stream=True))
    streaming: set[str] = set()
    while len(streaming) < n:
        assert sock.poll(30_000), "the streams did not start"
        streaming.update(rid for rid, _ in tokens_by_rid(decode(sock.recv())))
    faulted_at = time.monotonic()
    fault(status.worker_pid)
    errors: list[float] = []
    while len(errors) < n and sock.poll(60_000):
        msg = decode(sock.recv())
        if isinstance(msg, cp.Done):
            assert msg.finish_reason == "error" and reason in (msg.error or ""), msg
            errors.append(time.monotonic() - faulted_at)
    sock.close()
    return faulted_at, errors


def time_to_served(svc, ctx: zmq.Context, since: float, timeout_s: float = 120) -> tuple[float | None, Counter]:
    """Send small requests until one succeeds: seconds from ``since``, and the errors seen before."""
    sock = dealer(ctx, svc.address)
    errors: Counter = Counter()
    try:
        for i in itertools.count():
            if time.monotonic() - since > timeout_s:
                return None, errors
            sock.send(gen(f"p{i}", [5, 6, 7], 4))
            while True:
                if not sock.poll(30_000):
                    return None, errors
                msg = decode(sock.recv())
                if isinstance(msg, cp.Done):
                    break
            if msg.finish_reason == "length":
                return time.monotonic() - since, errors
            errors[(msg.error or msg.finish_reason).split(" (")[0].split(":")[0]] += 1
            time.sleep(0.02)
    finally:
        sock.close()
    raise AssertionError("unreachable")


def worker_faults(work: Path, folder: Path, streams: int) -> list[Row]:
    extra = "[cache]\nkv_slots = 16384\n[scheduler]\nmax_running = 32\nmax_context = 1024\n"
    rows = []
    with service(work, "kill", folder, extra) as (svc, probe, ctx):
        faulted_at, errors = _stream_then(
            svc, probe, ctx, streams, lambda pid: os.kill(pid, signal.SIGKILL), "worker died"
        )
        served, before = time_to_served(svc, ctx, faulted_at)
    rows += [
        Row("worker kill", "kill -> error replies (first / last)", _spread(errors, streams),
            f"SIGKILL of status.worker_pid while {streams} streams of 800 tokens run"),
        Row("worker kill", "kill -> next served request", _secs(served),
            f"a 4-token request every 20 ms until one succeeds; refused before: {_errors(before)}"),
    ]
    hang = extra + "[worker]\nstep_timeout_s = 5\n"
    with service(work, "hang", folder, hang) as (svc, probe, ctx):
        faulted_at, errors = _stream_then(
            svc, probe, ctx, streams, lambda pid: os.kill(pid, signal.SIGSTOP), "worker stopped responding"
        )
        served, before = time_to_served(svc, ctx, faulted_at)
    rows += [
        Row("worker hang", "SIGSTOP -> error replies (first / last)", _spread(errors, streams),
            f"SIGSTOP of the worker, worker.step_timeout_s = 5, {streams} streams in flight"),
        Row("worker hang", "SIGSTOP -> next served request", _secs(served),
            f"as above; refused before: {_errors(before)}"),
    ]
    with service(work, "restart", folder, extra) as (svc, probe, ctx):
        first = probe.status()
        assert first is not None
        killed_at = time.monotonic()
        os.kill(first.worker_pid, signal.SIGKILL)
        second = None
        while time.monotonic() - killed_at < 30:
            status = probe.status()
            if status is not None and status.worker_pid not in (0, first.worker_pid):
                second = status
                os.kill(status.worker_pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        served, before = time_to_served(svc, ctx, killed_at)
        after = probe.status()
    state = f"second kill {second.worker_state!r}" if second is not None else "no second worker seen"
    rows.append(Row("kill during restart", "first kill -> next served request", _secs(served),
                    f"the idle worker killed, then its replacement while it loads ({state}); "
                    f"restarts {after.worker_restarts if after else '?'}; refused before: {_errors(before)}"))
    return rows


def _spread(errors: list[float], expected: int) -> str:
    if not errors:
        return f"no error reply within 60 s (0/{expected})"
    return f"{errors[0]:.2f} / {errors[-1]:.2f} s ({len(errors)}/{expected})"


def _secs(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "never (timed out)"


def _errors(counts: Counter) -> str:
    return ", ".join(f"{n} x '{e}'" for e, n in counts.most_common()) or "none"


def flood(work: Path, folder: Path, count: int) -> list[Row]:
    extra = f"[cache]\nkv_slots = 16384\n[scheduler]\nmax_running = 64\nmax_context = 128\nmax_waiting = {count}\n"
    rng = random.Random(3)
    payloads = [gen(f"f{i}", [rng.randint(2, 255) for _ in range(3)], 1) for i in range(count)]
    with service(work, "flood", folder, extra) as (svc, probe, ctx):
        base_rss = probe.rss_mib()
        sock = dealer(ctx, svc.address, SNDHWM=0, RCVHWM=0)
        start = time.monotonic()
        for payload in payloads:
            sock.send(payload)
        sent_s = time.monotonic() - start
        done_at: list[float] = []
        overloaded = 0
        trace = []  # (t, waiting, replies so far, worker steps)
        peak_rss = base_rss
        next_sample = 0.0
        while len(done_at) < count and time.monotonic() - start < 240:
            if sock.poll(5):
                while sock.poll(0):
                    msg = decode(sock.recv())
                    if isinstance(msg, cp.Done):
                        done_at.append(time.monotonic() - start)
                        overloaded += "overloaded" in (msg.error or "")
            if time.monotonic() - start >= next_sample:
                status = probe.status()
                peak_rss = max(peak_rss, probe.rss_mib())
                if status is not None:
                    trace.append((time.monotonic() - start, status.waiting, len(done_at), status.steps))
                next_sample = time.monotonic() - start + 0.25
        sock.close()
    peak_waiting = max((w for _, w, _, _ in trace), default=0)
    high = _rate([(t, n, k) for t, w, n, k in trace if w >= 0.8 * peak_waiting])
    low = _rate([(t, n, k) for t, w, n, k in trace if 500 <= w <= 1500])
    how = (f"one DEALER (SNDHWM 0) sends {count:,} 3-token, 1-new-token requests in {sent_s:.1f} s; "
           f"max_waiting {count:,}, max_running 64")
    return [
        Row("flood", "replies / overloaded", f"{len(done_at):,} / {overloaded:,}", how),
        Row("flood", "scheduler RSS idle / peak", f"{base_rss:.0f} / {peak_rss:.0f} MiB",
            f"VmRSS of the `runtime up` process, sampled every 0.25 s; peak waiting {peak_waiting:,}"),
        Row("flood", "requests finished per second, ~all queued / ~1k queued", f"{high} / {low}",
            "replies (and worker steps) per second while status.waiting >= 80% of its peak, and while 500-1,500"),
        Row("flood", "time to answer all", f"{done_at[-1]:.1f} s" if done_at else "-", "from the first send"),
    ]


def _rate(window: list[tuple[float, int, int]]) -> str:
    """Replies (and steps) per second between the first and last status sample of ``window``."""
    if len(window) < 2 or window[-1][0] - window[0][0] <= 0:
        return "n/a (window too short)"
    (t0, n0, k0), (t1, n1, k1) = window[0], window[-1]
    return f"{(n1 - n0) / (t1 - t0):,.0f}/s ({(k1 - k0) / (t1 - t0):,.0f} steps/s)"


def flood_past_limit(work: Path, folder: Path, count: int) -> list[Row]:
    extra = "[cache]\nkv_slots = 16384\n[scheduler]\nmax_running = 64\nmax_context = 128\nmax_waiting = 1000\n"
    with service(work, "overload", folder, extra) as (svc, probe, ctx):
        sock = dealer(ctx, svc.address, SNDHWM=0, RCVHWM=0)
        for i in range(count):
            sock.send(gen(f"o{i}", [5, 6, i % 250 + 2], 1))
        replies: Counter = Counter()
        overloaded = 0
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 2.0:  # until nothing more comes for 2 s
            if sock.poll(100):
                msg = decode(sock.recv())
                if isinstance(msg, FINAL):
                    replies[msg.rid] += 1
                    overloaded += "overloaded" in (getattr(msg, "error", None) or "")
                quiet_since = time.monotonic()
        sock.close()
    exact = sum(1 for i in range(count) if replies[f"o{i}"] == 1)
    return [
        Row("flood past max_waiting", "overloaded errors", f"{overloaded:,} of {count:,}",
            f"{count:,} requests sent at once to max_waiting = 1,000"),
        Row("flood past max_waiting", "requests with exactly one reply", f"{exact:,} of {count:,}",
            f"{sum(replies.values()):,} final replies in all"),
    ]


def slow_readers(work: Path, folder: Path, count: int) -> list[Row]:
    extra = "[cache]\nkv_slots = 65536\n[scheduler]\nmax_running = 64\nmax_context = 2048\n"
    with service(work, "slow", folder, extra) as (svc, probe, ctx):
        sock = dealer(ctx, svc.address)
        rids = [f"{i:08d}".ljust(250, "r") for i in range(count)]
        for rid in rids:
            sock.send(gen(rid, [5, 6, 7], 1))
        queued = unanswered = 0
        start = time.monotonic()
        while time.monotonic() - start < 2.0:
            status = probe.status()
            unanswered += status is None
            queued = max(queued, status.replies_queued if status is not None else 0)
            time.sleep(0.05)
        got: set[str] = set()
        while len(got) < count and sock.poll(10_000):
            msg = decode(sock.recv())
            if isinstance(msg, cp.Done) and msg.finish_reason == "length":
                got.add(msg.rid)
        sock.close()
    rows = [
        Row("slow reader", "replies received", f"{len(got):,} of {count:,}",
            f"{count:,} requests with 250-character rids sent unread; reading starts 2 s later"),
        Row("slow reader", "most replies queued in the scheduler / status unanswered", f"{queued:,} / {unanswered}",
            "status.replies_queued, asked every 50 ms from another DEALER while not reading (5 s timeout)"),
    ]
    longs = 32
    with service(work, "never", folder, extra, server="slow_client_timeout_s = 3") as (svc, probe, ctx):
        base_rss = probe.rss_mib()
        sock = dealer(ctx, svc.address)
        start = time.monotonic()
        for rid in rids:
            sock.send(gen(rid, [5, 6, 7], 1))  # their replies fill the pipe
        for i in range(longs):
            sock.send(gen(f"long{i}", [5, 6, 7 + i], 2000))
        stalled = gone = None
        unanswered = 0
        peak_rss = base_rss
        while time.monotonic() - start < 40:
            status = probe.status()
            peak_rss = max(peak_rss, probe.rss_mib())
            if status is None:
                unanswered += 1
                continue
            if stalled is None and status.replies_queued:
                stalled = time.monotonic() - start
            if stalled is not None and status.running == 0 and status.waiting == 0:
                gone = time.monotonic() - start
                break
            time.sleep(0.02)
        sock.close()
    rows += [
        Row("never-reading client", "replies start queuing / requests aborted",
            f"{_secs(stalled)} / {_secs(gone)}",
            f"{count:,} short and {longs} 2,000-token requests, never read; slow_client_timeout_s = 3; "
            "from the first send to status.replies_queued > 0, and to running == waiting == 0"),
        Row("never-reading client", "status queries unanswered", str(unanswered),
            "asked every 20 ms from another DEALER (5 s timeout each) until the requests were gone"),
        Row("never-reading client", "scheduler RSS idle / peak", f"{base_rss:.0f} / {peak_rss:.0f} MiB",
            "VmRSS every 20 ms"),
    ]
    return rows


# ---- report --------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    lines = ["| scenario | figure | value | how it was measured |", "|---|---|---|---|"]
    lines += [f"| {r.scenario} | {r.figure} | {r.value} | {r.how} |" for r in rows]
    return "\n".join(lines)


def machine() -> str:
    import mlx.core as mx

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor())
    kind = "VM" if " hypervisor" in cpuinfo else "machine"
    system = f"{os.cpu_count()}-core {platform.system()} {kind}, {cpu}"
    return f"{system}, Python {platform.python_version()}, mlx {mx.__version__}"


DOC_INTRO = """# Reliability: the service under hostile clients and worker faults

Figures from `scripts/reliability.py`: a tiny random-weight llama served by a real
`runtime up` (one fresh service per scenario, ipc socket), driven by raw ZeroMQ sockets.

- **fuzz**: seeded random messages, the generators of `tests/test_protocol_fuzz.py`: frame
  layouts (one frame, a REQ envelope, 1-4 frames), random bytes, msgpack of random nested
  values, message-shaped maps with extreme field values, valid messages truncated, with a
  byte changed or trailing bytes, Aborts of recent requests, and deep nesting. Every message
  should get exactly one final reply (Done, ProtocolError, StatusReply or AbortReply); a crash
  is the service process exiting, a hang a status query unanswered within 5 s.
- **fuzz while starting**: the same kind of messages while the worker is still starting (frozen
  with SIGSTOP, then let go): status queries should be answered `starting` at once, requests
  held and run once the worker is ready, everything else answered at once; again one final
  reply per message.
- **disconnects**: clients that close their socket mid-stream. Their requests should be
  aborted (found by pings and failed sends) and their KV slots freed.
- **worker kill / hang / kill during restart**: the MLX worker SIGKILLed or SIGSTOPped with
  requests in flight. In-flight requests should fail with a clear error, and the service
  should serve again once a new worker has loaded (restart backoff: 0 s, then 1, 2, 4 s).
- **flood**: one client sending requests as fast as it can: replies, "overloaded" refusals,
  the scheduler's memory, and whether the step loop slows down with a long waiting queue.
- **slow reader / never-reading client**: replies the client does not read queue in the
  scheduler (per client, bounded); a client that reads none of them for
  `server.slow_client_timeout_s` has its requests aborted.

Every scenario asks for status from a separate, well-behaved connection; a status query left
unanswered for 5 s means the service stopped serving its other clients, and is a failure.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="write the doc (e.g. docs/RELIABILITY.md)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply message and request counts")
    parser.add_argument("--only", help="comma-separated scenarios to run (default: all)")
    args = parser.parse_args()
    s = args.scale
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        work = Path(tmp)
        folder = make_model("llama", work / "llama")
        steps: list[tuple[str, Callable[[], list[Row]]]] = [
            ("fuzz", lambda: fuzz(work, folder, int(20_000 * s))),
            ("fuzz while starting", lambda: startup_fuzz(work, folder, int(5_000 * s))),
            ("disconnects", lambda: disconnects(work, folder, max(1, int(50 * s)))),
            ("worker faults", lambda: worker_faults(work, folder, 16)),
            ("flood", lambda: flood(work, folder, int(100_000 * s))),
            ("flood past max_waiting", lambda: flood_past_limit(work, folder, int(5_000 * s))),
            ("slow readers", lambda: slow_readers(work, folder, int(3_000 * s))),
        ]
        wanted = set(args.only.split(",")) if args.only else {name for name, _ in steps}
        for name, step in steps:
            if name not in wanted:
                continue
            t = time.monotonic()
            new = step()
            rows += new
            print(f"{name}: {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
            for r in new:
                print(f"  {r.figure}: {r.value}", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started
    report = table(rows)
    print(report)
    if args.write:
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip()
        scale = "" if s == 1.0 else f" --scale {s:g}"
        args.write.write_text(
            DOC_INTRO
            + f"\n## Figures\n\n{report}\n\n"
            + f"Command: `python scripts/reliability.py{scale} --write {args.write}` ({elapsed / 60:.1f} minutes).  \n"
            + f"Machine: {machine()}.  \n"
            + f"Date: {datetime.date.today().isoformat()}; commit `{commit}`.\n"
        )


if __name__ == "__main__":
    main()
