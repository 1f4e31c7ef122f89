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
