"""What each rank of a tensor-parallel worker is started with: command, environment, host.

The environment follows mlx.launch's conventions, so ``mx.distributed.init`` in each rank finds
its group exactly as it would under ``mlx.launch``: ``MLX_RANK`` for every backend; for
``ring``, ``MLX_HOSTFILE`` names a JSON file listing each rank's ``"ip:port"`` addresses
(one port per rank and IP, counting up from a starting port); for ``nccl``, ``NCCL_HOST_IP``
and ``NCCL_PORT`` (rank 0's), ``MLX_WORLD_SIZE`` and one ``CUDA_VISIBLE_DEVICES`` per local
rank; for ``jaccl``, ``MLX_IBV_DEVICES`` (the hostfile's RDMA devices) and
``MLX_JACCL_COORDINATOR``. Without a hostfile every rank runs on this machine on 127.0.0.1.

Rank 0 connects to the scheduler's worker socket and binds one fan-out socket per follower:
ipc next to the scheduler's socket when every rank is local, else TCP on rank 0's first IP
(ports after the ring's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass

from runtime.config import Config, config_to_dict
from runtime.hostfile import Host, read_hostfile

MLX_LAUNCH_PORT = 32323  # mlx.launch's default --starting-port
LOCAL = Host("127.0.0.1", ("127.0.0.1",))


@dataclass(frozen=True)
class RankLaunch:
    """One rank: its argv, the variables to add to its environment, the files to write on its
    host (variable name -> content; the variable then holds the file's path), and its host."""

    rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    files: dict[str, str]
    host: Host

    @property
    def local(self) -> bool:
        return self.host.local


def resolve_backend(config: Config, hostfile_backend: str) -> str:
    """``auto`` as mlx.launch resolves it: the hostfile's backend, else nccl with CUDA, else ring.
    The scheduler does not import mlx, so CUDA is recognised by its driver's device node."""
    if config.distributed.backend != "auto":
        return config.distributed.backend
    if hostfile_backend in ("ring", "jaccl", "nccl"):
        return hostfile_backend
    return "nccl" if os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") else "ring"


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports free on 127.0.0.1 now (each rank's ring listener binds one)."""
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def plan_ranks(config: Config, worker_address: str) -> list[RankLaunch]:
    """Every rank's launch, rank 0 first; ``worker_address`` is the scheduler's worker socket."""
    n = config.worker.tensor_parallel
    hostfile = read_hostfile(config.distributed.hostfile) if config.distributed.hostfile else None
    hosts = list(hostfile.hosts) if hostfile is not None else [LOCAL] * n
    backend = resolve_backend(config, hostfile.backend if hostfile is not None else "")
    every_local = all(h.local for h in hosts)
    connections = sum(len(h.ips) for h in hosts)
    if config.distributed.starting_port:
        ports = list(range(config.distributed.starting_port, config.distributed.starting_port + connections + n))
    elif every_local:
        ports = free_ports(connections + n)
    else:
        ports = list(range(MLX_LAUNCH_PORT, MLX_LAUNCH_PORT + connections + n))
    ring_ports, fanout_ports = iter(ports[:connections]), ports[connections:]
    ring = [[f"{ip}:{next(ring_ports)}" for ip in h.ips] for h in hosts]
    if every_local:
        followers = [f"{worker_address}.rank{r}" for r in range(1, n)]
    else:
        followers = [f"tcp://{hosts[0].ips[0]}:{fanout_ports[r]}" for r in range(1, n)]
    local_ranks = {h.ssh: sum(1 for g in hosts if g.ssh == h.ssh) for h in hosts}
    shared_env = dict(e.split("=", 1) for e in (hostfile.envs if hostfile is not None else ()))
    launches = []
    for rank, host in enumerate(hosts):
        rank_config = _rank_config(config, backend, local_ranks[host.ssh])
        argv = [sys.executable, "-m", "runtime.worker.main", "--rank", str(rank),
                "--address", worker_address if rank == 0 else followers[rank - 1],
                "--config-json", json.dumps(config_to_dict(rank_config))]
        if rank == 0:
            argv += ["--followers", *followers]
        env = {**shared_env, "MLX_RANK": str(rank)}
        files: dict[str, str] = {}
        if backend == "ring":
            files["MLX_HOSTFILE"] = json.dumps(ring)
        elif backend == "nccl":
            local_index = sum(1 for g in hosts[:rank] if g.ssh == host.ssh)
            env.update(NCCL_HOST_IP=hosts[0].ips[0], NCCL_PORT=str(fanout_ports[0]), MLX_WORLD_SIZE=str(n),
                       CUDA_VISIBLE_DEVICES=str(local_index))
        else:  # jaccl
            files["MLX_IBV_DEVICES"] = json.dumps([list(h.rdma) for h in hosts])
            env["MLX_JACCL_COORDINATOR"] = f"{hosts[0].ips[0]}:{fanout_ports[0]}"
        if host.local and "OPENBLAS_NUM_THREADS" not in os.environ:
            # Ranks on one machine share its cores; the scheduler keeps one.
            env["OPENBLAS_NUM_THREADS"] = str(max(1, ((os.cpu_count() or 2) - 1) // local_ranks[host.ssh]))
        launches.append(RankLaunch(rank, tuple(argv), env, files, host))
    return launches


def _rank_config(config: Config, backend: str, ranks_here: int) -> Config:
    """The config a rank runs with: the backend resolved, and ranks on one machine splitting its
    share of memory for the KV pool (each holds 1/N of the heads, so the pools still hold as many
    tokens as one worker's)."""
    cache = dataclasses.replace(config.cache, kv_memory_fraction=config.cache.kv_memory_fraction / ranks_here)
    distributed = dataclasses.replace(config.distributed, backend=backend)
    return dataclasses.replace(config, cache=cache, distributed=distributed)
