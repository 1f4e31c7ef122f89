"""The tiny shapes every test model shares, and the plain-decoder config most families start from."""

from __future__ import annotations

from typing import Any

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
VOCAB = 256
MAX_POS = 2048


def dense(model_type: str, architecture: str, **fields: Any) -> dict:
    """A plain decoder (GQA attention, 2 layers) with the fields every such family shares."""
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        **fields,
    }


def linear_attn_fields() -> dict:
    """Gated delta-net widths of the Qwen3-Next / Qwen3.5 families."""
    return {
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    }


def qwen3_5_text(**fields: Any) -> dict:
    """Qwen3.5's text config: gated delta-net layers (0, 2) and gated full attention (1, 3),
    interleaved mRoPE on half the head; ``fields`` add or replace (the MoE variant's experts)."""
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        **linear_attn_fields(),
        "num_experts": 0,  # dense MLP
        "full_attention_interval": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **fields,
    }
