"""Checks across a parsed config's keys: ranges, choices, and keys that need each other."""

from __future__ import annotations

from runtime.config.sections import (
    MAX_GATEWAY_WORKERS,
    Config,
    ConfigError,
    HttpConfig,
    is_loopback,
)


def validate(config: Config) -> None:
    """Raise ConfigError, naming the key, for the first value a person must fix."""
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
    for key in ("fuse_projections", "pad_shapes"):
        if getattr(config.worker, key) not in ("auto", "on", "off"):
            raise ConfigError(f"config key 'worker.{key}' must be 'auto', 'on' or 'off'")
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
