"""The `runtime` command line: config errors, load failures, status, generate, shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, running_config, running_service
from model_factory import reference_greedy


def _runtime(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.mark.parametrize(
    "body, needle",
    [
        ('[model]\npath = "/x"\nbogus = 1\n', "model.bogus"),
        ('[model]\npath = "/x"\n[scheduler]\nmax_running = "many"\n', "scheduler.max_running"),
        ('[model]\npath = "/x"\n[nonsense]\na = 1\n', "nonsense"),
        ('[server]\naddress = "ipc://"\n', "model.path"),
        ('[model]\npath = "/x"\n[cache]\nenabled = "yes"\n', "cache.enabled"),
        ("[model\n", "not valid TOML"),
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path, body, needle):
    config = tmp_path / "bad.toml"
    config.write_text(body)
    done = _runtime("up", "-c", str(config))
    assert done.returncode == 2
    assert needle in done.stderr


def test_minimal_config_is_enough(model_dir, tmp_path):
    """Only [model] path and [server] address: everything else defaults."""
    folder = model_dir("llama")
    with running_service(tmp_path, folder) as svc:
        done = _runtime("status", "-a", svc.address)
    assert done.returncode == 0
    assert "model_type: llama" in done.stdout


def test_unloadable_model_exits_nonzero_with_loader_error(model_dir, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((model_dir("llama") / name).read_bytes())
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{folder}"\n[server]\naddress = "ipc://"\n')
    done = _runtime("up", "-c", str(config), timeout=120)
    assert done.returncode != 0
    assert "No safetensors found" in done.stderr


def test_status_with_nothing_listening_fails_fast(tmp_path):
    start = time.monotonic()
    done = _runtime("status", "-a", f"ipc://{tmp_path}/nothing.sock", "--timeout", "2")
    assert done.returncode != 0
    assert time.monotonic() - start < 20
    assert "no reply" in done.stderr


def test_generate_json_and_streaming(model_dir, tmp_path):
    folder = model_dir("llama")
    with running_service(tmp_path, folder) as svc:
        as_json = _runtime("generate", "-a", svc.address, "--json", "--max-tokens", "6", "--ignore-eos", "hello world")
        streamed = _runtime("generate", "-a", svc.address, "--max-tokens", "6", "--ignore-eos", "hello world")
    assert as_json.returncode == 0, as_json.stderr
    result = json.loads(as_json.stdout)
    assert set(result) >= {"token_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens"}
    assert result["finish_reason"] == "length"
    from runtime.scheduler.tokenizer import Tokenizer

    prompt = Tokenizer(str(folder)).encode("hello world")
    assert result["token_ids"] == reference_greedy(folder, prompt, 6)
    assert result["prompt_tokens"] == len(prompt)
    assert streamed.returncode == 0
    assert streamed.stdout.rstrip("\n") == result["text"]


def test_generate_sampling_flags_stop_and_chat(tmp_path):
    adder = REPO / "models" / "adder"
    with running_service(tmp_path, adder, "[scheduler]\nmax_context = 64\n") as svc:
        stopped = _runtime("generate", "-a", svc.address, "--json", "--stop", "79", "123+456=")
        seeded = [_runtime("generate", "-a", svc.address, "--json", "--temperature", "1.5", "--top-k", "3",
                           "--top-p", "0.9", "--seed", "4", "--max-tokens", "6", "--ignore-eos", "1+1=")
                  for _ in range(2)]
        bad = _runtime("generate", "-a", svc.address, "--json", "--top-p", "2", "1+1=")
        chat = _runtime("generate", "-a", svc.address, "--json", "--chat", "1+1=")
    assert json.loads(stopped.stdout)["text"] == "5" and json.loads(stopped.stdout)["stop_reason"] == "79"
    runs = [json.loads(r.stdout) for r in seeded]
    assert seeded[0].returncode == 0 and runs[0]["token_ids"] == runs[1]["token_ids"]  # the same seed
    assert bad.returncode == 1 and "top_p" in json.loads(bad.stdout)["error"]
    assert chat.returncode == 1 and "chat template" in json.loads(chat.stdout)["error"]  # the adder has none


def test_generate_flags_reach_the_request(model_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = model_dir("llama")  # random weights: sampling at a high temperature leaves greedy's path
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = "a b c"
    ids = tok.encode(prompt)
    chat_ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    flags = ("--json", "--max-tokens", "8", "--ignore-eos")
    with running_service(tmp_path, folder, "[scheduler]\nmax_context = 128\n") as svc:
        def run(*extra: str) -> dict:
            done = _runtime("generate", "-a", svc.address, *flags, *extra, prompt)
            assert done.returncode == 0, done.stdout + done.stderr
            return json.loads(done.stdout)

        top1 = run("--temperature", "5", "--top-k", "1", "--seed", "3")
        hot = [run("--temperature", "5", "--seed", str(seed)) for seed in (3, 4)]
        chat = run("--chat")
    greedy = reference_greedy(folder, ids, 8)
    assert top1["token_ids"] == greedy  # --top-k 1 at any temperature is greedy
    assert hot[0]["token_ids"] != greedy and hot[0]["token_ids"] != hot[1]["token_ids"]  # temperature, seeds
    assert chat["prompt_tokens"] == len(chat_ids) and chat["token_ids"] == reference_greedy(folder, chat_ids, 8)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_within_10s_leaving_no_process(model_dir, tmp_path, sig):
    folder = model_dir("llama")
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{folder}"\n[server]\naddress = "ipc://"\n')
    with running_config(config) as svc:
        proc = svc.proc
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children, "the worker process should be a child of the scheduler"
        start = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=10)
        assert time.monotonic() - start < 10
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_whole_group_stops_quietly(model_dir, tmp_path, sig):
    # A terminal's Ctrl-C (SIGINT) or a service manager's stop (systemd: SIGTERM to the whole
    # control group) reaches the scheduler, the worker and the gateway at once. The service
    # stops with its own line: no tracebacks, and no restart of a worker taken for crashed.
    port = _free_port()
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{model_dir("llama")}"\n[server]\naddress = "ipc://"\n'
                      f'[http]\naddress = "127.0.0.1:{port}"\n')
    with running_config(config) as svc:
        deadline = time.monotonic() + 60
        while not any("HTTP on" in line for line in list(svc.lines)):
            assert time.monotonic() < deadline and svc.proc.poll() is None, svc.log()
            time.sleep(0.05)  # polling the reader thread's list, bounded by the deadline
        os.killpg(svc.proc.pid, sig)
        svc.proc.wait(timeout=15)
        time.sleep(0.5)  # the reader thread drains the last lines of the closed pipe
        log = svc.log()
    assert "runtime: stopped" in log, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "restarting the worker" not in log, log


def test_default_config_serves_the_embedded_adder():
    """`runtime up -c configs/default.toml` plus one `runtime generate` gives a correct sum."""
    import httpx

    with running_config(REPO / "configs" / "default.toml") as svc:
        done = _runtime("generate", "-a", svc.address, "123+456=")
        as_json = json.loads(_runtime("generate", "-a", svc.address, "--json", "250+250=").stdout)
        # The README's curl line: the same config serves HTTP on 127.0.0.1:8000 once it says so.
        deadline = time.monotonic() + 60
        while not any("HTTP on http://127.0.0.1:8000" in line for line in list(svc.lines)):
            assert time.monotonic() < deadline and svc.proc.poll() is None, svc.log()
            time.sleep(0.05)  # polling the reader thread's list, bounded by the deadline
        over_http = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=30,
                               json={"model": "adder", "prompt": "123+456=", "max_tokens": 8, "temperature": 0}).json()
    assert over_http["choices"][0]["text"] == "579" and over_http["choices"][0]["finish_reason"] == "stop"
    assert done.returncode == 0 and done.stdout.strip() == "579"
    assert as_json["text"] == "500" and as_json["finish_reason"] == "stop"


def test_tcp_address_binds_loopback(model_dir, tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "tcp.toml"
    config.write_text(f'[model]\npath = "{model_dir("llama")}"\n[server]\naddress = "tcp://:{port}"\n')
    with running_config(config) as svc:
        assert svc.address == f"tcp://127.0.0.1:{port}"
        done = _runtime("generate", "-a", svc.address, "--json", "--max-tokens", "3", "--ignore-eos", "hi")
    assert done.returncode == 0 and len(json.loads(done.stdout)["token_ids"]) == 3
