"""worker.tensor_parallel = 2 on this CPU (ring backend on localhost): the same tokens as mlx-lm,
rank deaths handled as worker deaths, no process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time

import mlx.core as mx
import pytest
from conftest import REPO, running_service
from model_factory import load_cached, reference_greedy
from test_service_errors import wait_worker_up

from runtime.client import Client, RequestFailed
from runtime.config import ConfigError, parse_config
from runtime.scheduler.rank_launch import plan_ranks

TP = "[worker]\ntensor_parallel = 2\nstartup_timeout_s = 120\n[distributed]\nbackend = \"ring\"\n"
EXTRA = TP + "[cache]\nkv_slots = 4096\naux_slots = 64\ntrack_chunk = 16\n[scheduler]\nmax_running = 8\nmax_context = 512\ndebug_invariants = true\n"
NEAR_TIE = 1e-3  # a top-2 logprob gap this small may flip under another summation order


def _ranks_of(service_pid: int) -> dict[int, int]:
    """rank -> pid of the worker ranks the service started (its direct children)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == service_pid and "runtime.worker.main" in argv and "--rank" in argv:
            ranks[int(argv[argv.index("--rank") + 1])] = int(entry)
    return ranks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(8, 60))] for _ in range(count)]


def assert_same_or_near_tie(folder, prompt: list[int], got: list[int], max_tokens: int) -> None:
    """``got`` is mlx-lm's greedy continuation, or parts from it only where mlx-lm's own top-2
    logprobs are within NEAR_TIE (the ranks sum partial products in another order)."""
    ref = reference_greedy(folder, prompt, max_tokens)
    if got == ref:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
    model, _ = load_cached(folder)
    logits = model(mx.array([prompt + ref[:first]]))[0, -1].astype(mx.float32)
    top2 = mx.sort(logits - mx.logsumexp(logits))[-2:].tolist()
    gap = top2[1] - top2[0]
    assert gap < NEAR_TIE, f"tokens differ at {first} where mlx-lm's top-2 gap is {gap:.2e}: {got} vs {ref}"
    print(f"near-tie difference at token {first} (mlx-lm's top-2 logprob gap {gap:.2e})")


# ---- config and launch plan (no processes) -----------------------------------------------------

def _config(tmp_path, **worker_and_distributed) -> dict:
    (tmp_path / "config.json").write_text("{}")
    table: dict = {"model": {"path": str(tmp_path)}}
    for section, values in worker_and_distributed.items():
        table[section] = values
    return table


@pytest.mark.parametrize("table, needle", [
    ({"worker": {"tensor_parallel": 0}}, "worker.tensor_parallel"),
    ({"distributed": {"backend": "mpi"}}, "distributed.backend"),
    ({"worker": {"tensor_parallel": 2}, "distributed": {"backend": "jaccl"}}, "needs 'distributed.hostfile'"),
    ({"worker": {"tensor_parallel": 2}, "distributed": {"hostfile": "/no/such/hosts.json"}}, "hostfile not found"),
])
def test_config_errors_name_the_key(tmp_path, table, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(_config(tmp_path, **table))


def test_hostfile_must_list_one_host_per_rank_with_rank_0_here(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}]))
    with pytest.raises(ConfigError, match="lists 1 hosts but 'worker.tensor_parallel' is 2"):
        parse_config(_config(tmp_path, worker={"tensor_parallel": 2}, distributed={"hostfile": str(hosts)}))
    hosts.write_text(json.dumps({"hosts": [{"ssh": "mac-a.invalid", "ips": ["10.0.0.1"]},
                                           {"ssh": "mac-b.invalid", "ips": ["10.0.0.2"]}]}))
    with pytest.raises(ConfigError, match="host 0 .* must be this machine"):
        parse_config(_config(tmp_path, worker={"tensor_parallel": 2}, distributed={"hostfile": str(hosts)}))


def test_plan_for_two_local_ring_ranks(tmp_path):
    config = parse_config(_config(tmp_path, worker={"tensor_parallel": 2}, distributed={"backend": "ring"},
                                  cache={"kv_memory_fraction": 0.5}))
    plans = plan_ranks(config, "ipc:///tmp/x/worker.sock")
    assert [p.rank for p in plans] == [0, 1] and all(p.local for p in plans)
    assert [p.env["MLX_RANK"] for p in plans] == ["0", "1"]
    ring = json.loads(plans[0].files["MLX_HOSTFILE"])
    assert len(ring) == 2 and all(len(node) == 1 and node[0].startswith("127.0.0.1:") for node in ring)
    assert plans[0].files == plans[1].files  # every rank reads the same ring
    argv0, argv1 = list(plans[0].argv), list(plans[1].argv)
    assert argv0[argv0.index("--address") + 1] == "ipc:///tmp/x/worker.sock"
    assert argv0[argv0.index("--followers") + 1:] == ["ipc:///tmp/x/worker.sock.rank1"]
    assert argv1[argv1.index("--address") + 1] == "ipc:///tmp/x/worker.sock.rank1"
    rank_config = json.loads(argv1[argv1.index("--config-json") + 1])
    assert rank_config["cache"]["kv_memory_fraction"] == 0.25  # two ranks share this machine's memory


# ---- the service ---------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def served(request, model_dir, tmp_path_factory):
    folder = model_dir(request.param)
    with running_service(tmp_path_factory.mktemp("tp"), folder, EXTRA, timeout=120) as svc:
        yield folder, svc


async def test_greedy_single_batched_and_prefix_hits_match_mlx_lm(served):
    folder, svc = served
    prompts = _prompts(1, 8)
    shared = _prompts(2, 1)[0] * 2
    async with Client(svc.address, timeout_s=120) as client:
        single = await client.generate(token_ids=prompts[0], max_tokens=24, ignore_eos=True)
        batched = await asyncio.gather(*(client.generate(token_ids=p, max_tokens=16, ignore_eos=True)
                                         for p in prompts))
        again = await asyncio.gather(*(client.generate(token_ids=p, max_tokens=16, ignore_eos=True)
                                       for p in prompts[:4]))
        first = await client.generate(token_ids=shared + [7], max_tokens=12, ignore_eos=True)
        sharing = await client.generate(token_ids=shared + [9, 11], max_tokens=12, ignore_eos=True)
    assert_same_or_near_tie(folder, prompts[0], single.token_ids, 24)
    for prompt, result in zip(prompts, batched):
        assert_same_or_near_tie(folder, prompt, result.token_ids, 16)
    for prompt, result in zip(prompts, again):
        assert result.cached_tokens > 0, "an exact repeat hits the prefix cache"
        assert_same_or_near_tie(folder, prompt, result.token_ids, 16)
    assert sharing.cached_tokens >= 16 and first.finish_reason == "length"
    assert_same_or_near_tie(folder, shared + [9, 11], sharing.token_ids, 12)


def test_each_rank_pools_its_own_heads(served):
    """The pools are sized after sharding: the start-up line reports rank 0's KV and aux pools,
    half of what one worker holds for the same config (loaded here, in process, unsharded)."""
    from runtime.config import parse_config
    from runtime.worker.loader import load

    folder, svc = served
    config = parse_config({"model": {"path": str(folder)}, "cache": {"kv_slots": 4096, "aux_slots": 64},
                           "scheduler": {"max_running": 8, "max_context": 512}})
    kv, aux = load(config).make_pools()
    one_worker = kv.nbytes + (aux.nbytes if aux is not None else 0)
    match = re.search(r"4096 KV slots float32 ([0-9.]+) MiB", svc.log())
    assert match and abs(float(match.group(1)) - one_worker / 2 / 2**20) < 0.05, (match, one_worker)


async def test_ranks_sample_the_same_tokens(served):
    """Unseeded random sampling, then a greedy request over what it produced: the cached K/V (and
    hybrid state) of every rank must be those of the same tokens, or mlx-lm's continuation differs."""
    folder, svc = served
    prompt = _prompts(3, 1)[0]
    async with Client(svc.address, timeout_s=120) as client:
        sampled = await asyncio.gather(*(client.generate(token_ids=prompt, max_tokens=20, temperature=1.0,
                                                         ignore_eos=True) for _ in range(3)))
        follow = [prompt + s.token_ids for s in sampled]
        greedy = await asyncio.gather(*(client.generate(token_ids=f, max_tokens=8, ignore_eos=True)
                                        for f in follow))
    assert len({tuple(s.token_ids) for s in sampled}) > 1, "random seeds per request"
    for ids, result in zip(follow, greedy):
        assert result.cached_tokens > len(prompt), "the sampled tokens' K/V came from the cache"
        assert_same_or_near_tie(folder, ids, result.token_ids, 8)


async def test_structured_output_masks_reach_every_rank(served):
    """Constrained rows wait for a Masks message per step (rank 0 forwards those too); the
    greedy follow-up over their output checks every rank sampled the constrained tokens."""
    folder, svc = served
    pattern = r"[a-f]{3,12}z"
    async with Client(svc.address, timeout_s=120) as client:
        constrained = await asyncio.gather(*(client.generate(token_ids=[7, 20 + i, 30], max_tokens=20, regex=pattern,
                                                             temperature=1.0) for i in range(4)))
        follow = [[7, 20 + i, 30] + r.token_ids for i, r in enumerate(constrained)]
        greedy = await asyncio.gather(*(client.generate(token_ids=f, max_tokens=8, ignore_eos=True) for f in follow))
    for r in constrained:
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), (r.finish_reason, r.text)
    for ids, result in zip(follow, greedy):
        # The hybrid keeps its state only at tracking-chunk boundaries: no hit this short.
        assert result.cached_tokens > 3 or folder.name.startswith("qwen3_5")
        assert_same_or_near_tie(folder, ids, result.token_ids, 8)


async def test_killing_a_rank_restarts_every_rank(model_dir, tmp_path):
    folder = model_dir("llama")
    extra = TP.replace("[distributed]", "step_timeout_s = 5\n[distributed]") + "[cache]\nkv_slots = 8192\n[scheduler]\nmax_running = 1\nmax_context = 4096\n"
    with running_service(tmp_path, folder, extra, timeout=120) as svc:
        before = _ranks_of(svc.proc.pid)
        assert sorted(before) == [0, 1]
        async with Client(svc.address, timeout_s=120) as client:
            waiting_prompt = _prompts(4, 1)[0]
            waiting = None
            with pytest.raises(RequestFailed, match="worker died"):
                async for chunk in client.stream(token_ids=[5, 6, 7], max_tokens=3000, ignore_eos=True):
                    if waiting is None:  # running now; a second request queues behind max_running = 1
                        waiting = asyncio.create_task(
                            client.generate(token_ids=waiting_prompt, max_tokens=10, ignore_eos=True))
                        # A generous reply time: two ranks decoding flat out on a 2-CPU machine
                        # once starved the scheduler past status()'s default 5 s (CI, session 20).
                        while (await client.status(timeout=30)).waiting != 1:
                            await asyncio.sleep(0.02)
                        os.kill(before[1], signal.SIGKILL)
            queued = await asyncio.wait_for(waiting, 120)  # runs after the restart
            status = await wait_worker_up(client, timeout=120)
            after = _ranks_of(svc.proc.pid)
            # A rank that hangs (stopped) leaves rank 0 waiting in a collective: the step timeout.
            with pytest.raises(RequestFailed, match="worker stopped responding"):
                async for chunk in client.stream(token_ids=[8, 9], max_tokens=3000, ignore_eos=True):
                    if _alive(after[1]) and chunk.token_ids:
                        os.kill(after[1], signal.SIGSTOP)
            hung_status = await wait_worker_up(client, timeout=120)
            final = _ranks_of(svc.proc.pid)
            recovered = await client.generate(token_ids=waiting_prompt, max_tokens=10, ignore_eos=True)
        assert queued.finish_reason == "length"
        assert_same_or_near_tie(folder, waiting_prompt, queued.token_ids, 10)
        assert status.worker_restarts == 1
        assert sorted(after) == [0, 1] and not set(after.values()) & set(before.values())
        assert not _alive(before[0]), "rank 0 of the dead group was killed too"
        assert hung_status.worker_restarts == 2 and recovered.token_ids == queued.token_ids
        assert not any(_alive(pid) for pid in after.values()), "the hung group was killed, the stopped rank too"
        assert sorted(final) == [0, 1]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in final.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in final.values()), "no rank outlives the service"


def test_architecture_without_shard_is_refused_at_load(model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="'qwen3_next' has no tensor-parallel sharding in mlx-lm"):
        with running_service(tmp_path, model_dir("qwen3_next"), TP, timeout=120):
            pass


def test_plan_for_a_second_host_uses_tcp_and_ssh(tmp_path):
    """Only the plan and the remote shell line: no second host is reachable from the tests."""
    from runtime.scheduler.rank_processes import _remote_script

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": [
        {"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "mac-b.invalid", "ips": ["10.0.0.2"]}]}))
    config = parse_config(_config(tmp_path, worker={"tensor_parallel": 2},
                                  distributed={"backend": "ring", "hostfile": str(hosts), "starting_port": 40000}))
    local, remote = plan_ranks(config, "ipc:///tmp/x/worker.sock")
    assert local.local and not remote.local
    assert json.loads(local.files["MLX_HOSTFILE"]) == [["127.0.0.1:40000"], ["10.0.0.2:40001"]]
    argv0 = list(local.argv)
    assert argv0[argv0.index("--followers") + 1:] == ["tcp://127.0.0.1:40003"]  # after the ring's ports
    assert remote.env["MLX_RANK"] == "1" and remote.env["MLX_METAL_FAST_SYNCH"] == "1"
    line = _remote_script(remote)
    assert 'MLX_HOSTFILE=$(mktemp) && printf %s' in line and "exec env " in line and "MLX_RANK=1" in line
    assert "--address tcp://127.0.0.1:40003" in line


def test_ranks_agree_on_a_start_up_decision_only_where_every_rank_makes_it(tmp_path):
    """Two ring ranks on this machine: a flag one rank sets and the other does not is off on both
    (a hybrid's padded prompts change a forward's shapes, which every rank must share)."""
    import socket
    import subprocess
    import sys

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hosts = tmp_path / "ring.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    code = ("import mlx.core as mx\nfrom runtime.worker.ranks import agree_all\n"
            "g = mx.distributed.init(strict=True, backend='ring')\n"
            "print(agree_all(g.rank() == 0, g), agree_all(True, g), flush=True)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "MLX_RANK": str(rank),
                                                                 "MLX_HOSTFILE": str(hosts)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
             for rank in range(2)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [o.strip() for o, _ in outs] == ["False True", "False True"], [e[-500:] for _, e in outs]
