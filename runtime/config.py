"""Service configuration: TOML in, frozen dataclasses out, every key checked."""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


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
    ``Engine.overlap_submit``) and read back first without it.

    ``compile_decode``: run each decode step as one ``mx.compile``d function per batch shape:
    on the CPU (``runtime/worker/paths/rows/compiled_decode.py``) and on the CUDA kernel path
    (``compiled_paged.py``). Not used on Metal yet (not measured or checked token-exact there).
    At most 256 step shapes stay compiled per path (``TraceCache``, least recently used
    dropped): a trace costs about 0.1 MiB of host memory per layer.

    ``attention_threads``: with compiled decode on the CPU, a batch of 8 rows or more computes
    its attention in groups of rows on this many MLX CPU streams (threads), bit-identical to
    one stream; 0 = one per CPU, at most 4; 1 = one stream.

    ``buffer_cache_mb``: MLX's cache of freed buffers. MLX's CPU default (32 MiB) is smaller
    than one decode step's temporaries at moderate batch sizes, and missing it costs a
    fresh allocation and page faults for every temporary (2-3x slower steps); 0 picks four
    times the pools' size (at most an eighth of memory, never less than MLX's default).

    ``fuse_projections``: run attention's q/k/v and the MLP's gate/up projections of a
    one-token input as one matrix-vector product each (``runtime/worker/model/fused_projections.py``;
    bit-identical, fewer kernels per one-row decode step). ``auto``: on a GPU, where such a
    step is host-bound, for models whose decode step is compiled (attention layers only,
    ``compile_decode`` on); ``on``; ``off``.

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
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
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


def _check_type(key: str, value: object, hint: object) -> object:
    if typing.get_origin(hint) is tuple:  # tuple[str, ...]: a TOML list of strings, kept immutable
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"config key '{key}' must be a list of strings, got {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = hint if isinstance(hint, type) else None
    if expected is None or isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"config key '{key}' must be {name}, got {type(value).__name__} {value!r}")
    return value


def _optional_section(hint: object) -> object:
    """``Section | None`` (a table that may be absent) as ``Section``; other hints unchanged."""
    args = typing.get_args(hint)
    if len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        if dataclasses.is_dataclass(inner):
            return inner
    return hint


def _build(cls: type, table: dict, prefix: str) -> object:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"unknown config key '{dotted}' (known: {', '.join(sorted(known))})")
        hint = _optional_section(hints[key])
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{dotted}' must be a table")
            values[key] = _build(hint, value, f"{dotted}.")
        else:
            values[key] = _check_type(dotted, value, hint)
    return cls(**values)


def parse_config(table: dict, base_dir: Path | None = None) -> Config:
    """Build a Config from a parsed TOML table; relative model paths resolve against ``base_dir``."""
    config = _build(Config, table, "")
    assert isinstance(config, Config)
    if not config.model.path:
        raise ConfigError("config key 'model.path' is required (a folder holding an MLX model)")
    path = Path(config.model.path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        candidate = (base_dir / path).resolve()
        # Configs in configs/ name repo paths relative to the repo root or to themselves.
        path = candidate if candidate.exists() else path.resolve()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(path)))
    _validate(config)
    return config


def _validate(config: Config) -> None:
    s, c = config.scheduler, config.cache
    if s.max_running < 0:
        raise ConfigError("config key 'scheduler.max_running' must not be negative (0: chosen for the device)")
    if s.max_step_tokens < 0 or s.prefill_chunk < 0:
        raise ConfigError("config keys 'scheduler.max_step_tokens' and 'scheduler.prefill_chunk' must not be "
                          "negative (0: chosen for the device)")
    if not 0.0 <= s.admit_window_ms <= 1000.0:
        raise ConfigError("config key 'scheduler.admit_window_ms' must be between 0 and 1000")
    if s.max_context < 0 or c.kv_slots < 0:
        raise ConfigError("config keys 'scheduler.max_context' and 'cache.kv_slots' must not be negative")
    if s.max_waiting < 1:
        raise ConfigError("config key 'scheduler.max_waiting' must be at least 1")
    if config.worker.step_timeout_s <= 0 or config.server.slow_client_timeout_s <= 0:
        raise ConfigError("config keys 'worker.step_timeout_s' and 'server.slow_client_timeout_s' must be positive")
    if not 0 < config.server.max_message_mb <= 1024:
        raise ConfigError("config key 'server.max_message_mb' must be in (0, 1024]")
    if config.worker.attention_threads < 0:
        raise ConfigError("config key 'worker.attention_threads' must not be negative")
    if config.worker.buffer_cache_mb < 0 or config.worker.overlap_submit_max_mb < 0:
        raise ConfigError("config keys 'worker.buffer_cache_mb' and 'worker.overlap_submit_max_mb' must not be negative")
    if c.aux_slots < 0 or c.track_chunk < 1:
        raise ConfigError("config keys 'cache.aux_slots' must not be negative and 'cache.track_chunk' must be at least 1")
    if not 0.0 < c.kv_memory_fraction <= 0.95:
        raise ConfigError("config key 'cache.kv_memory_fraction' must be in (0, 0.95]")
    addr = config.server.address
    if not (addr.startswith("ipc://") or addr.startswith("tcp://")):
        raise ConfigError(f"config key 'server.address' must start with ipc:// or tcp://, got {addr!r}")
    if config.worker.blas not in ("auto", "bundled"):
        raise ConfigError("config key 'worker.blas' must be 'auto' or 'bundled'")
    if config.worker.fuse_projections not in ("auto", "on", "off"):
        raise ConfigError("config key 'worker.fuse_projections' must be 'auto', 'on' or 'off'")
    _validate_distributed(config)
    if config.server.curve_client_keys and not config.server.curve_secret_key:
        raise ConfigError("config key 'server.curve_client_keys' needs 'server.curve_secret_key' (`runtime keygen`)")
    if config.server.curve_secret_key:
        from runtime.protocol.security import (  # zmq only when CURVE is on
            SecurityError,
            check_key,
        )

        named = [("server.curve_secret_key", config.server.curve_secret_key)]
        named += [(f"server.curve_client_keys[{i}]", k) for i, k in enumerate(config.server.curve_client_keys)]
        try:
            for name, key in named:
                check_key(key, f"config key '{name}'")
        except SecurityError as exc:
            raise ConfigError(str(exc)) from None
    if config.http is not None:
        _validate_http(config.http)
        if config.server.curve_client_keys:
            raise ConfigError("config key 'server.curve_client_keys' cannot be combined with [http] yet "
                              "(the gateway connects with a fresh key pair)")


DISTRIBUTED_BACKENDS = ("auto", "ring", "jaccl", "nccl")


def _validate_distributed(config: Config) -> None:
    tp, d = config.worker.tensor_parallel, config.distributed
    if not 1 <= tp <= 64:
        raise ConfigError(f"config key 'worker.tensor_parallel' must be between 1 and 64 (ranks that share the "
                          f"model), got {tp}")
    if d.backend not in DISTRIBUTED_BACKENDS:
        raise ConfigError(f"config key 'distributed.backend' must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                          f"got {d.backend!r}")
    if not 0 <= d.starting_port < 65536 - 2 * tp:
        raise ConfigError("config key 'distributed.starting_port' must be 0 (free ports) or a TCP port with "
                          "room for two ports per rank after it")
    if not d.hostfile:
        if tp > 1 and d.backend == "jaccl":
            raise ConfigError("config key 'distributed.backend' = 'jaccl' needs 'distributed.hostfile' "
                              "(its hosts' RDMA devices)")
        return
    from runtime.hostfile import HostfileError, read_hostfile

    try:
        hosts = read_hostfile(d.hostfile).hosts
    except HostfileError as exc:
        raise ConfigError(f"config key 'distributed.hostfile': {exc}") from None
    if len(hosts) != tp:
        raise ConfigError(f"config key 'distributed.hostfile' lists {len(hosts)} hosts but "
                          f"'worker.tensor_parallel' is {tp} (one host entry per rank)")
    if tp > 1 and not all(h.ips for h in hosts):
        raise ConfigError("config key 'distributed.hostfile': every host needs 'ips' (the ring and the step "
                          "fan-out connect to IP addresses)")
    if not hosts[0].local:
        raise ConfigError(f"config key 'distributed.hostfile': host 0 ({hosts[0].ssh!r}) must be this machine "
                          "(rank 0 talks to the scheduler over a local socket)")


def _validate_http(http: HttpConfig) -> None:
    host = http.host  # raises on a malformed address
    if not 1 <= http.workers <= MAX_GATEWAY_WORKERS:
        raise ConfigError(f"config key 'http.workers' must be 1..{MAX_GATEWAY_WORKERS}, got {http.workers}")
    if any(not key.strip() for key in http.api_keys):
        raise ConfigError("config key 'http.api_keys' must not hold empty keys")
    if not http.api_keys and not is_loopback(host):
        raise ConfigError(
            f"config key 'http.address' is {http.address!r}, not loopback: set 'http.api_keys' "
            "so the HTTP API is not open to anyone on the network"
        )


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML config file."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return parse_config(table, base_dir=path.parent)


def config_to_dict(config: Config) -> dict:
    """Plain-dict form, for handing the config to the worker process (absent sections left out)."""
    return {key: value for key, value in dataclasses.asdict(config).items() if value is not None}


__all__ = ["Config", "ConfigError", "DistributedConfig", "HttpConfig", "load_config", "parse_config", "config_to_dict"]
