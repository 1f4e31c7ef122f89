"""Fast checks of the bench's building blocks (no service processes are started here)."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from runtime.bench.main import build_parser
from runtime.bench.measure import StreamTiming, median_summary, percentile, summarize
from runtime.bench.models import shape_config, synthetic_model, write_weights
from runtime.bench.service import ServiceSpec
from runtime.bench.tokenizers import write_tokenizer
from runtime.config import parse_config


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert math.isnan(percentile([], 50))


def test_stream_timing_and_summary():
    t = StreamTiming(start=0.0)
    t.add([1], at=0.5)
    t.add([2, 3], at=1.0)  # two tokens in one delivery: one gap and one zero gap
    t.add([4], at=1.5)
    assert t.ttft == 0.5 and t.itls() == [0.5, 0.0, 0.5]
    s = summarize([t])
    assert s["output_tokens"] == 4 and s["total_tok_s"] == pytest.approx(4 / 1.5)
    assert s["decode_tok_s"] == pytest.approx(3 / 1.0)
    assert median_summary([{"a": 1, "b": 1.0}, {"a": 3, "b": 2.0}, {"a": 2, "b": 9.0}]) == {"a": 2, "b": 2.0}


def test_service_toml_is_a_valid_config(tmp_path):
    spec = ServiceSpec(model=tmp_path, max_running=8, max_context=600, kv_slots=5000, cache_enabled=False)
    config = parse_config(tomllib.loads(spec.toml()))
    assert config.scheduler.max_running == 8 and config.scheduler.max_context == 600
    assert config.cache.kv_slots == 5000 and config.cache.enabled is False
    assert "max_step_tokens" not in spec.toml() and "prefill_chunk" not in spec.toml()  # 0: the service's default
    chosen = ServiceSpec(model=tmp_path, max_running=8, max_context=600, kv_slots=0, max_step_tokens=1024,
                         prefill_chunk=128)
    assert parse_config(tomllib.loads(chosen.toml())).scheduler.max_step_tokens == 1024
    assert parse_config(tomllib.loads(chosen.toml())).scheduler.prefill_chunk == 128
    assert config.worker.fuse_projections == "auto"
    off = ServiceSpec(model=tmp_path, max_running=1, max_context=64, kv_slots=100, fuse_projections="off")
    assert parse_config(tomllib.loads(off.toml())).worker.fuse_projections == "off"
    user = ServiceSpec(model=tmp_path, max_running=0, max_context=0, kv_slots=0)  # --service-defaults
    assert not any(key in user.toml() for key in ("max_running", "max_context", "kv_slots"))
    defaults = parse_config(tomllib.loads(user.toml()))
    assert (defaults.scheduler.max_running, defaults.scheduler.max_context, defaults.cache.kv_slots) == (0, 0, 0)


def test_synthetic_tiny_loads_with_mlx_lm_and_transformers(tmp_path):
    from mlx_lm.utils import load_model
    from transformers import AutoTokenizer

    folder = synthetic_model("tiny", tmp_path)
    assert synthetic_model("tiny", tmp_path) == folder  # reused, not rewritten
    model, cfg = load_model(folder)
    assert cfg["vocab_size"] == 1000 and cfg["eos_token_id"] == 999
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.eos_token_id == 999 and tok.decode([5, 6]) == "t5 t6"


def test_sharded_weights_have_a_complete_index(tmp_path):
    from mlx_lm.utils import load_model

    cfg = shape_config("tiny")
    write_tokenizer(tmp_path, cfg["vocab_size"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_weights(tmp_path, cfg, shard_bytes=4 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    load_model(tmp_path)  # strict: every parameter present


def test_a_4bit_shape_is_a_quantized_model_served_token_exact(tmp_path):
    import mlx.nn as nn
    from harness import InProcessService
    from mlx_lm.utils import load_model
    from model_factory import reference_greedy

    from runtime.worker.model.flat_quantized import (
        FlatQuantizedEmbedding,
        FlatQuantizedLinear,
    )

    folder = synthetic_model("tiny-4bit", tmp_path)
    model, cfg = load_model(folder)
    assert cfg["quantization"] == {"group_size": 64, "bits": 4}
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and isinstance(model.lm_head, nn.QuantizedLinear)
    svc = InProcessService(folder, max_running=4)
    served = svc.engine.model  # its quantized products over (rows, width)
    assert type(served.model.embed_tokens) is FlatQuantizedEmbedding and type(served.lm_head) is FlatQuantizedLinear
    reqs = [svc.request(f"q{i}", [5 + i, 17, 42, 9 + i], 8) for i in range(4)]
    svc.run({0: reqs})  # one batch of 4 decode rows
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, 8)


def test_mixed_with_the_bytes_tokenizer_is_refused_before_anything_runs(capsys, tmp_path):
    from runtime.bench.main import main

    with pytest.raises(SystemExit) as exc:
        main(["--synthetic", "tiny", "--synthetic-tokenizer", "bytes", "--workloads", "single,mixed",
              "--work-dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "mixed workload needs the words tokenizer" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no model written, no service started


def test_parser_lists():
    args = build_parser().parse_args(["--synthetic", "tiny", "--concurrency", "1,4", "--workloads", "all"])
    assert args.concurrency == [1, 4]
    assert args.workloads == ["single", "sweep", "prefix", "memory", "paired", "first", "sampling", "http", "long", "mixed",
                              "structured"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--synthetic", "tiny", "--workloads", "nope"])


def test_every_synthetic_shape_builds_its_mlx_lm_model():
    from runtime.bench.models import SHAPES, _param_specs

    for shape in SHAPES:  # lazily: no weights drawn, so the 1B shapes cost nothing here
        names = [name for name, _ in _param_specs(shape_config(shape))]
        assert any("embed_tokens" in n for n in names) and any("layers.0." in n for n in names), shape


def test_parser_offers_every_synthetic_shape():
    from runtime.bench.models import SHAPES

    for shape in SHAPES:  # the 4-bit shapes too: a GPU plan item once asked for one the parser refused
        assert build_parser().parse_args(["--synthetic", shape]).synthetic == shape


def test_sampling_workload_reports_the_median_of_per_round_ratios():
    from runtime.bench.measure import StreamTiming
    from runtime.bench.sampling import Sampling
    from runtime.bench.workloads import Bench

    def run(tokens: int, seconds: float) -> list[StreamTiming]:
        timing = StreamTiming(start=0.0)
        timing.add(list(range(tokens)), at=seconds)
        return [timing]

    plan = Sampling(Bench(Path("."), 100, {99}, 0, print), streams=1, prompt_len=4, gen_len=8, rounds=3)
    plan.greedy = [run(100, 1.0), run(100, 1.0), run(100, 2.0)]  # 100, 100, 50 tok/s
    plan.sampled = [run(90, 1.0), run(50, 1.0), run(40, 2.0)]  # ratios 0.9, 0.5, 0.4
    outcome = plan.outcome()
    assert outcome.data["ratio_median"] == pytest.approx(0.5)
    assert "median" in outcome.tables[0] and "0.50" in outcome.tables[0]


def test_http_workload_compares_the_gateway_with_the_client():
    from runtime.bench.http import Http
    from runtime.bench.workloads import Bench

    plan = Http(Bench(Path("."), 100, {99}, 0, print), streams=4, prompt_len=4, gen_len=8, pairs=3)
    plan.itl = {"zmq": [10.0, 10.0, 10.0], "http": [10.2, 10.8, 10.4]}
    plan.tok_s = {"zmq": [100.0, 100.0], "http": [95.0, 91.0]}
    outcome = plan.outcome()
    assert outcome.data["itl_ratio_median"] == pytest.approx(1.04)
    assert outcome.data["throughput_ratios"] == pytest.approx([0.91, 0.95])
    assert "at most 1.05" in outcome.tables[0]


def test_structured_workload_runs_half_constrained_rounds(model_dir, tmp_path, capsys):
    import json

    from runtime.bench.main import run

    out = tmp_path / "structured.json"
    args = build_parser().parse_args([
        "--model", str(model_dir("llama")), "--workloads", "structured", "--sampling-streams", "4",
        "--sampling-rounds", "1", "--prompt-len", "8", "--gen-len", "12", "--work-dir", str(tmp_path), "--json", str(out),
    ])
    assert run(args) == 0
    data = json.loads(out.read_text())["workloads"]["structured"]
    assert data["streams"] == 4 and len(data["free_tok_s"]) == len(data["half_constrained_tok_s"]) == 1
    assert data["constrained_tokens"] == [2 * 12]  # two constrained streams ran to max_tokens
    assert data["ratio_median"] > 0
    assert len(data["mask_ms_per_step"]) == 1 and data["mask_ms_per_step"][0] > 0  # the scheduler's mask clock
    assert "structured output cost" in capsys.readouterr().out
