"""The config file's sections as frozen dataclasses (the config reference), and ``ConfigError``."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A config file a person must fix; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: which model folder the worker loads."""

    path: str = ""
    seed: int = 0


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: where clients connect.

    ``ipc://`` (the default, a socket file in a private temp directory) or
    ``tcp://HOST:PORT``; ``tcp://:PORT`` binds ``host`` (127.0.0.1 by default).

    ``max_message_mb``: the largest client message the socket accepts (a bigger one closes
    that client's connection). ``slow_client_timeout_s``: a client that reads none of its
    replies for this long has its requests aborted and its unsent replies dropped.
    ``curve_secret_key`` (Z85): turns on ZeroMQ CURVE encryption and authentication;
    ``curve_client_keys`` (Z85 public keys) are the clients allowed in (empty: any client
    that knows the server's public key). A TCP address other than loopback is refused
    without CURVE unless ``allow_insecure`` is set.
    """

    address: str = "ipc://"
    host: str = "127.0.0.1"
    max_message_mb: float = 4.0
    slow_client_timeout_s: float = 30.0
    curve_secret_key: str = ""
    curve_client_keys: tuple[str, ...] = ()
    allow_insecure: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    """``[scheduler]``: batching limits.

    ``admit_window_ms``: a request that finds the service idle waits this long before its
    step is planned, so requests sent together (a client's burst) share one prefill step
    instead of one step each behind a full pipeline.

    ``max_waiting``: requests queued beyond the running batch; past it a request is refused
    at once with an "overloaded, retry later" error.

    ``max_running``, ``max_step_tokens``, ``prefill_chunk`` and ``max_context``: 0 (the
    default) lets the worker choose them for its device and model
    (``runtime/worker/defaults.py``); the start-up line says what was chosen.
    """

    max_running: int = 0
    max_step_tokens: int = 0
    prefill_chunk: int = 0
    max_context: int = 0
    admit_window_ms: float = 1.0
    max_waiting: int = 4096
    debug_invariants: bool = False


@dataclass(frozen=True)
class CacheConfig:
    """``[cache]``: the KV pool and the radix prefix cache over it.

    The pool holds ``kv_slots`` tokens; 0 sizes it as ``kv_memory_fraction`` of
    the device's memory, capped by ``max_running * max_context``. Hybrid models also
    get ``aux_slots`` recurrent-state slots (0: eight per running request), and their
    state is snapshotted every ``track_chunk`` prompt tokens for prefix reuse.
    """

    enabled: bool = True
    kv_slots: int = 0
    kv_memory_fraction: float = 0.25
    aux_slots: int = 0
    track_chunk: int = 64


@dataclass(frozen=True)
class WorkerConfig:
    """``[worker]``: the MLX process.

    ``step_timeout_s``: a worker that returns no step for this long while steps are in
    flight is declared hung, killed and restarted (its requests fail with "worker stopped
    responding"). The default leaves room for first-call kernel builds on a GPU and long
    prefill chunks of large models on a CPU.

    ``overlap_submit_max_mb``: on a GPU, submit every decode step N+1 before reading step N
    back when the KV and aux pools together are at most this size. That hides the launch
    cost, but MLX then copies the pools on each write (a graph in flight still holds them),
    so it only pays for small pools. Decode steps that write nothing in place (the CUDA
    kernel path's decode tail) are always submitted first. On the CPU, decode steps are
    submitted first with ``compile_decode`` (their writes stay in place there, see
    ``worker/overlap.py``) and read back first without it.

    ``compile_decode``: run each decode step as one ``mx.compile``d function per batch shape:
    on the CPU and, where shapes are padded (``pad_shapes``), a CUDA GPU's row-cache path
    (``runtime/worker/paths/rows/compiled_decode.py``), and on the CUDA kernel path
    (``compiled_paged.py``). Not used on Metal yet (not measured or checked token-exact there).
    At most 256 step shapes stay compiled per path (``TraceCache``, least recently used
    dropped): a trace costs about 0.1 MiB of host memory per layer.

    ``attention_threads``: with compiled decode on the CPU (never on a GPU), a batch of 8 rows
    or more computes its attention in groups of rows on this many MLX CPU streams (threads),
    bit-identical to one stream; 0 = one per CPU, at most 4; 1 = one stream.

    ``buffer_cache_mb``: MLX's cache of freed buffers. MLX's CPU default (32 MiB) is smaller
    than one decode step's temporaries at moderate batch sizes, and missing it costs a
    fresh allocation and page faults for every temporary (2-3x slower steps); 0 picks four
    times the pools' size (at most an eighth of memory, never less than MLX's default).

    ``fuse_projections``: run attention's q/k/v and the MLP's gate/up projections of a
    one-token input as one matrix-vector product each (``runtime/worker/model/fused_projections.py``;
    bit-identical, fewer kernels per one-row decode step). ``auto``: on a GPU, where such a
    step is host-bound, for models whose decode step is compiled (attention layers only,
    ``compile_decode`` on); ``on``; ``off``.

    ``pad_shapes``: round forwards up to a few dozen recurring shapes, so that the kernels a GPU
    builds at a shape's first use (50-90 ms each) recur: prefill query lengths, row counts and
    key lengths (``runtime/worker/paths/prefill_shapes.py``), and on a GPU the row-cache decode
    step compiled over bucketed lengths. On a GPU, padded products and attention round
    differently from mlx-lm's unpadded ones in the last bits (as mlx-lm's own
    ``prefill_step_size`` does), enough to part greedy tokens at near-ties. ``auto``: on a GPU;
    ``on``; ``off``: every forward at its own length, as mlx-lm runs it (on a GPU, mixed traffic
    then pays a kernel build for most new prompts: an H100 served half the tokens, session 31).

    ``tensor_parallel``: worker ranks that share the model through mlx.distributed (each holds
    1/N of the heads and MLP columns; ``[distributed]`` says how they connect); 1 = one process.
    """

    startup_timeout_s: float = 600.0
    step_timeout_s: float = 120.0
    restart: bool = True
    blas: str = "auto"
    overlap_submit_max_mb: int = 1024
    buffer_cache_mb: int = 0
    compile_decode: bool = True
    attention_threads: int = 0
    fuse_projections: str = "auto"
    pad_shapes: str = "auto"
    tensor_parallel: int = 1


@dataclass(frozen=True)
class DistributedConfig:
    """``[distributed]``: how the ranks of a ``worker.tensor_parallel`` worker talk (mlx.distributed).

    ``backend``: ``ring`` (TCP; Macs and CPUs), ``jaccl`` (RDMA over Thunderbolt), ``nccl``
    (CUDA) or ``auto`` (nccl where CUDA is available, else ring, as mlx.launch picks).
    ``hostfile``: the hosts, one per rank, in mlx.launch's JSON format (empty: every rank on
    this machine). ``starting_port``: the first TCP port of the ring (one per rank and IP)
    and, after those, of rank 0's step fan-out; 0 = free ports on this machine, 32323 (mlx.launch's
    default) with a hostfile.
    """

    backend: str = "auto"
    hostfile: str = ""
    starting_port: int = 0


MAX_GATEWAY_WORKERS = 64


@dataclass(frozen=True)
class HttpConfig:
    """``[http]``: the OpenAI-compatible HTTP gateway (``runtime/gateway/``); absent = none.

    ``address``: ``HOST:PORT`` it listens on. ``api_keys``: bearer keys a request must carry
    (empty: no authentication, allowed only on a loopback host). ``served_model_name``: the
    model id clients see (empty: the model folder's name). ``workers``: gateway processes,
    all serving one listening socket (the kernel spreads connections over them); their
    metrics are summed at every scrape.
    """

    address: str = "127.0.0.1:8000"
    api_keys: tuple[str, ...] = ()
    served_model_name: str = ""
    workers: int = 1

    @property
    def host(self) -> str:
        """The host part of ``address``, without IPv6 brackets."""
        return split_host_port(self.address)[0]

    @property
    def port(self) -> int:
        return split_host_port(self.address)[1]


def split_host_port(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[V6]:PORT"``) as (host, port); ConfigError when malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"config key 'http.address' must be HOST:PORT with a port in 1-65535, got {address!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); ``*``, ``0.0.0.0``,
    other names and LAN addresses are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Config:
    """The whole service configuration, frozen after loading; ``http`` is None without ``[http]``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    http: HttpConfig | None = None
