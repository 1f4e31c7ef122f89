"""The worker process: receive steps, launch them, report finalized tokens.

Loop shape: a step is launched (queued on the device) before the previous one is read
back, so the device always has the next step while Python reads and reports the last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import zmq

from runtime.config import Config, parse_config
from runtime.protocol.worker import (
    LoadFailed,
    Ready,
    Shutdown,
    Step,
    StepDone,
    StepFailed,
    worker_cmd_decoder,
    worker_encoder,
)

PARENT_POLL_MS = 500


def serve(config: Config, address: str) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    parent = os.getppid()
    try:
        import mlx.core as mx

        from runtime.worker.engine import Engine
        from runtime.worker.loader import load

        mx.random.seed(config.model.seed)
        loaded = load(config)
        layout = loaded.layout
        pool, aux_pool = loaded.make_pools()
        engine = Engine(loaded.model, layout, pool, config.scheduler.max_running, loaded.max_context, aux_pool)
    except Exception as exc:  # report the loader's error, then exit non-zero
        sock.send(worker_encoder.encode(LoadFailed(error=f"{type(exc).__name__}: {exc}")))
        time.sleep(0.2)
        return 1
    sock.send(
        worker_encoder.encode(
            Ready(
                model_type=loaded.model_type,
                num_slots=loaded.num_slots,
                max_rows=config.scheduler.max_running,
                max_context=loaded.max_context,
                vocab_size=loaded.vocab_size,
                dtype=str(layout.kv_dtype).replace("mlx.core.", ""),
                pool_bytes=pool.nbytes,
                aux_slots=loaded.aux_slots,
                aux_bytes=aux_pool.nbytes if aux_pool is not None else 0,
            )
        )
    )
    pending = None
    while True:
        if pending is not None and not sock.poll(0):
            pending = _finish(engine, sock, pending)
            continue
        if pending is None and not sock.poll(PARENT_POLL_MS):
            if os.getppid() != parent:
                return 0  # the scheduler is gone
            continue
        cmd = worker_cmd_decoder.decode(sock.recv())
        if isinstance(cmd, Shutdown):
            if pending is not None:
                _finish(engine, sock, pending)
            return 0
        assert isinstance(cmd, Step)
        try:
            launched = engine.launch(cmd)
        except Exception as exc:
            if pending is not None:
                pending = _finish(engine, sock, pending)
            engine.reset_chain()
            traceback.print_exc()
            sock.send(worker_encoder.encode(StepFailed(step_id=cmd.step_id, error=f"{type(exc).__name__}: {exc}")))
            continue
        if pending is not None:
            _finish(engine, sock, pending)
        pending = launched


def _finish(engine, sock: zmq.Socket, launched) -> None:
    try:
        tokens = engine.finalize(launched)
    except Exception as exc:
        engine.reset_chain()
        sock.send(worker_encoder.encode(StepFailed(step_id=launched.step_id, error=f"{type(exc).__name__}: {exc}")))
        return None
    sock.send(worker_encoder.encode(StepDone(step_id=launched.step_id, tokens=tokens)))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="runtime MLX worker (started by the scheduler)")
    parser.add_argument("--address", required=True)
    parser.add_argument("--config-json", required=True)
    args = parser.parse_args(argv)
    config = parse_config(json.loads(args.config_json))
    return serve(config, args.address)


if __name__ == "__main__":
    sys.exit(main())
