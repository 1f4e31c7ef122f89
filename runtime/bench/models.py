"""Synthetic random-weight model folders (mlx-lm layout) for benchmarking.

A folder is written once per shape under ``<work_dir>/models/`` and reused; a marker
file written last tells a complete folder from an interrupted one. Weights are drawn
tensor by tensor with ``mx.random`` and flushed to safetensors shards as they fill, so
writing never holds much more than one shard in memory.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.bench.tokenizers import write_byte_tokenizer, write_tokenizer

FORMAT_VERSION = 1
MARKER = "bench-complete.json"
SHARD_BYTES = 4 << 30  # split weights into files of about this size

_BASE: dict = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
}

_GEMMA3: dict = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "sliding_window_pattern": 6,
}

_GPT_OSS: dict = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
}

_DEEPSEEK_V3: dict = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "q_lora_rank": None,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}

_QWEN3_NEXT: dict = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "rms_norm_eps": 1e-6,
    "full_attention_interval": 4,  # three gated delta-net layers, then one gated full attention
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "num_experts": 0,  # a dense MLP in every layer (``mlp_only_layers``)
    "num_experts_per_tok": 0,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 0,
    "moe_intermediate_size": 0,
    "norm_topk_prob": True,
}

SHAPES: dict[str, dict] = {
    # CPU-sized: hidden 256, 4 layers, vocab 1000, float32.
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 1024,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
    },
    # Llama-3.2-1B geometry.
    "llama-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    },
    # Llama-3.1-8B geometry.
    "llama-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    },
    # Gemma 3 (sliding-window layers beside global ones, six 1 + weight RMSNorms a block): a
    # CPU-sized one in float32 and Gemma-3-1B's geometry.
    "gemma3-tiny": {**_GEMMA3, "hidden_size": 256, "num_hidden_layers": 12, "intermediate_size": 1024,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "query_pre_attn_scalar": 64,
                    "vocab_size": 1000, "sliding_window": 128, "max_position_embeddings": 8192,
                    "tie_word_embeddings": False, "torch_dtype": "float32"},
    "gemma3-1b": {**_GEMMA3, "hidden_size": 1152, "num_hidden_layers": 26, "intermediate_size": 6912,
                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
                  "vocab_size": 262144, "sliding_window": 512, "max_position_embeddings": 32768,
                  "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    # gpt-oss (windows of 128 beside full layers, attention sinks, a mixture of experts): a
    # CPU-sized one in float32, and gpt-oss-20b's attention and widths in bf16 with 8 experts
    # of its 32 (13 GB where the real one is 42 GB in bf16; it ships its experts in MXFP4).
    "gpt-oss-tiny": {**_GPT_OSS, "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 256,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 4,
                     "vocab_size": 1000, "max_position_embeddings": 8192, "tie_word_embeddings": False,
                     "torch_dtype": "float32"},
    "gpt-oss-20b-8e": {**_GPT_OSS, "hidden_size": 2880, "num_hidden_layers": 24, "intermediate_size": 2880,
                       "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 8,
                       "vocab_size": 201088, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                       "torch_dtype": "bfloat16"},
    # DeepSeek-V3's multi-head latent attention (one 512-wide latent and a 64-wide rotary key
    # cached per token), routed and shared experts, the first layer dense: a CPU-sized one in
    # float32, and Moonlight-16B-A3B's widths in bf16 with 8 of its 64 experts (7 GB).
    "deepseek-v3-tiny": {**_DEEPSEEK_V3, "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
                         "moe_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
                         "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                         "vocab_size": 1000, "rope_theta": 10000.0, "max_position_embeddings": 8192,
                         "tie_word_embeddings": False, "torch_dtype": "float32"},
    "moonlight-16b-8e": {**_DEEPSEEK_V3, "hidden_size": 2048, "num_hidden_layers": 27, "intermediate_size": 11264,
                         "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_key_value_heads": 16,
                         "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                         "n_routed_experts": 8, "num_experts_per_tok": 6, "n_shared_experts": 2,
                         "routed_scaling_factor": 2.446, "vocab_size": 163840, "rope_theta": 50000.0,
                         "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # Qwen3-Next / Qwen3.5's hybrid stack (gated delta-net layers, recurrent state per request,
    # beside gated full attention): a CPU-sized one in float32, and Qwen3-Next-80B-A3B's
    # attention and delta-net widths over 24 layers with a dense MLP in place of its 512 experts
    # (bf16, 4.3 GB).
    "qwen3-next-tiny": {**_QWEN3_NEXT, "hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 1024,
                        "mlp_only_layers": list(range(8)), "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "vocab_size": 1000,
                        "rope_theta": 10000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
                        "torch_dtype": "float32"},
    "qwen3-next-24l-dense": {**_QWEN3_NEXT, "hidden_size": 2048, "num_hidden_layers": 24,
                             "intermediate_size": 5120, "mlp_only_layers": list(range(24)),
                             "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                             "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                             "linear_value_head_dim": 128, "vocab_size": 151936, "rope_theta": 10000000.0,
                             "max_position_embeddings": 262144, "tie_word_embeddings": False,
                             "torch_dtype": "bfloat16"},
}

# Each shape also in 4 bits ("llama-8b-4bit"): every matrix quantized as mlx-lm's own
# ``convert -q`` does by default (affine, group 64), the norms left in the shape's dtype.
QUANTIZATION = {"group_size": 64, "bits": 4}
SHAPES.update({f"{name}-4bit": {**cfg, "quantization": dict(QUANTIZATION)} for name, cfg in list(SHAPES.items())})

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def shape_config(shape: str) -> dict:
    """The full config.json of a synthetic shape (EOS is the last id)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")
    cfg = {**copy.deepcopy(_BASE), **copy.deepcopy(SHAPES[shape])}
    cfg["eos_token_id"] = cfg["vocab_size"] - 1
    return cfg


def _param_specs(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the model's parameters, from a lazily built (never evaluated) model."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(copy.deepcopy(cfg)))
    return [(name, tuple(p.shape)) for name, p in tree_flatten(model.parameters())]


def _init(name: str, shape: tuple[int, ...], dtype: mx.Dtype, key: mx.array) -> mx.array:
    """Norm scales are ones; embeddings N(0, 0.02); other matrices N(0, 1/fan_in)."""
    if len(shape) < 2:
        return mx.ones(shape, dtype=dtype)
    std = 0.02 if "embed" in name else shape[-1] ** -0.5
    return (mx.random.normal(shape, key=key) * std).astype(dtype)


def write_weights(
    folder: Path,
    cfg: dict,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    log: Callable[[str], None] | None = None,
) -> int:
    """Draw every parameter and save ``model-0000i-of-0000N.safetensors`` + index; return bytes."""
    dtype = _DTYPES[cfg["torch_dtype"]]
    specs = _param_specs(cfg)
    keys = mx.random.split(mx.random.key(seed), len(specs))
    shards: list[list[str]] = [[]]
    current: dict[str, mx.array] = {}
    current_bytes = total = 0
    tmp_names: list[Path] = []

    def flush() -> None:
        nonlocal current, current_bytes
        if not current:
            return
        path = folder / f"shard-{len(tmp_names):05d}.tmp.safetensors"
        mx.save_safetensors(str(path), current, metadata={"format": "mlx"})
        tmp_names.append(path)
        if log is not None:
            log(f"wrote weight shard {len(tmp_names)} ({current_bytes / 2**30:.2f} GiB)")
        shards.append([])
        current, current_bytes = {}, 0

    quant = cfg.get("quantization")
    for i, (name, shape) in enumerate(specs):
        w = _init(name, shape, dtype, keys[i])
        arrays = {name: w}
        if quant is not None and len(shape) == 2 and name.endswith(".weight") and shape[-1] % quant["group_size"] == 0:
            q, scales, biases = mx.quantize(w, group_size=quant["group_size"], bits=quant["bits"])
            stem = name.removesuffix(".weight")
            arrays = {name: q, f"{stem}.scales": scales, f"{stem}.biases": biases}
        mx.eval(arrays)
        size = sum(a.nbytes for a in arrays.values())
        if current and current_bytes + size > shard_bytes:
            flush()
        current.update(arrays)
        shards[-1].extend(arrays)
        current_bytes += size
        total += size
    flush()
    n = len(tmp_names)
    weight_map = {}
    for i, path in enumerate(tmp_names):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        path.rename(folder / final)
        for name in shards[i]:
            weight_map[name] = final
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def synthetic_model(
    shape: str, work_dir: Path, seed: int = 0, log: Callable[[str], None] | None = None, tokenizer: str = "words"
) -> Path:
    """Return the folder of a synthetic model, writing it first if it is not complete.
    ``tokenizer``: "words" (``write_tokenizer``) or "bytes" (``write_byte_tokenizer``)."""
    cfg = shape_config(shape)
    folder = Path(work_dir) / "models" / (f"synthetic-{shape}-s{seed}" + ("-bytes" if tokenizer == "bytes" else ""))
    marker = folder / MARKER
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("format") == FORMAT_VERSION and info.get("config") == cfg:
            return folder
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    if log is not None:
        log(f"writing synthetic {shape} model to {folder}")
    (write_byte_tokenizer if tokenizer == "bytes" else write_tokenizer)(folder, cfg["vocab_size"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    total = write_weights(folder, cfg, seed=seed, log=log)
    marker.write_text(json.dumps({"format": FORMAT_VERSION, "config": cfg, "bytes": total}))
    mx.clear_cache()  # give the drawing buffers back before services start on the same device
    # The page cache's write-back of a new folder (16 GB for the 8B) would otherwise compete
    # with the timed runs for the host: in session 20's GPU A/Bs the run right after a model
    # write was the slower one both times (the likely cause, not a proven one).
    if log is not None:
        log(f"flushing {total / 1e9:.1f} GB to disk before timing")
    os.sync()
    return folder


def model_vocab(folder: Path) -> tuple[int, set[int]]:
    """(vocab_size, EOS ids) read from a model folder's config.json."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    vocab = int(text.get("vocab_size") or cfg.get("vocab_size"))
    eos = cfg.get("eos_token_id", text.get("eos_token_id"))
    eos_ids = set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
    return vocab, eos_ids
