"""Recent dense (and a few MoE / looped) decoders: GLM, Qwen v1, TeleChat3, MiMo, nanochat,
Baichuan-M1, Youtu, Lille, Mellum, Nanbeige, Phi-3-small, Talkie, Solar-Open, Ministral3,
IQuest-Loop, PLaMo, Llama-4 text."""
from __future__ import annotations

from factory_shapes import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    MAX_POS,
    VOCAB,
    dense,
)


def _cfg_glm() -> dict:
    # GLM (v1 "glm"): fused gate_up_proj, traditional (interleaved) full-width RoPE, q/k/v biases.
    return dense("glm", "GlmForCausalLM", attention_bias=True, tie_word_embeddings=False)


def _cfg_qwen() -> dict:
    # Qwen v1: one fused, biased c_attn (q, k, v), MHA, MLP of width intermediate_size // 2.
    return {
        "model_type": "qwen",
        "architectures": ["QWenLMHeadModel"],
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_hidden_layers": 2,
        "kv_channels": HIDDEN // HEADS,
        "max_position_embeddings": MAX_POS,
        "layer_norm_epsilon": 1e-6,
        "intermediate_size": INTERMEDIATE * 2,
        "no_bias": True,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_telechat3() -> dict:
    # Llama layout with biased MLP and attention projections (o_proj too).
    return dense("telechat3", "Telechat3ForCausalLM", attention_bias=True, mlp_bias=True,
                 tie_word_embeddings=False)


def _cfg_mimo() -> dict:
    # Qwen2-like: q/k/v biases, head_dim = hidden / heads; MTP layers dropped at load.
    return dense("mimo", "MiMoForCausalLM", num_nextn_predict_layers=1, tie_word_embeddings=False)


def _cfg_nanochat() -> dict:
    # Weightless RMS norms everywhere (embeddings, q/k after RoPE with negated freqs), ReLU^2
    # MLP, untied head, logits soft-capped at 15.
    return dense("nanochat", "NanoChatForCausalLM", tie_word_embeddings=False)


def _cfg_baichuan_m1() -> dict:
    # Fused W_pack, a 2-tap causal conv over K and V (its last K/V in an ArraysCache, so each
    # layer's cache is CacheList(ArraysCache, KV)); layer 0 sliding-window (8), layer 1 global.
    return {
        "model_type": "baichuan_m1",
        "architectures": ["BaichuanM1ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rope_theta": 10000.0,
        "sliding_window": 8,
        "sliding_window_layers": [0],
        "conv_window": 2,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


def _cfg_youtu_llm() -> dict:
    # Multi-head latent attention (deepseek_v2 style: full per-head keys cached) with a
    # low-rank query, traditional RoPE on the 8-wide rotary part, tied embeddings.
    return {
        "model_type": "youtu_llm",
        "architectures": ["YoutuForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "kv_lora_rank": 32,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }


def _cfg_lille_130m() -> dict:
    # gpt-style field names; fused qkv_proj, norms inside attention / MLP, traditional RoPE,
    # tied embeddings.
    return {
        "model_type": "lille-130m",
        "architectures": ["LilleForCausalLM"],
        "block_size": MAX_POS,
        "layer_norm_eps": 1e-5,
        "n_embd": HIDDEN,
        "n_head": HEADS,
        "n_kv_heads": KV_HEADS,
        "n_layer": 2,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def _cfg_mellum() -> dict:
    # MoE in every layer (4 experts, two per token), q/k norms, sliding-window layer (8) then a
    # full one, each layer type with its own RoPE base.
    return dense("mellum", "MellumForCausalLM", num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"],
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 500000.0}},
                 tie_word_embeddings=False)


def _cfg_nanbeige() -> dict:
    # Looped decoder: the 2-layer stack runs twice with shared weights (4 KV caches), the final
    # norm after each loop.
    return dense("nanbeige", "NanbeigeForCausalLM", num_loops=2, tie_word_embeddings=False)


def _cfg_phi3small() -> dict:
    # Fused biased query_key_value (grouped per KV head), block-sparse attention on layer 0
    # (32-token blocks, 1 local block, vertical stride 2: matters past 32 tokens), dense layer 1,
    # GeGELU MLP, LayerNorms, muP scales, tied embeddings. The vocab must cover the ids its
    # head masks (100256..100351): the real size, 100352.
    return {
        "model_type": "phi3small",
        "architectures": ["Phi3SmallForCausalLM"],
        "hidden_size": HIDDEN,
        "dense_attention_every_n_layers": 2,
        "ff_intermediate_size": INTERMEDIATE,
        "gegelu_limit": 20.0,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": 100352,
        "mup_attn_multiplier": 1.0,
        "mup_use_scaling": True,
        "mup_embedding_multiplier": 10.0,
        "mup_width_multiplier": 8.0,
        "rope_embedding_base": 1000000.0,
        "blocksparse_block_size": 32,
        "blocksparse_num_local_blocks": 1,
        "blocksparse_vert_stride": 2,
        "max_position_embeddings": MAX_POS,
        "tie_word_embeddings": True,
    }


def _cfg_talkie() -> dict:
    # MHA with negated-frequency RoPE, weightless q/k norms after RoPE and a per-head query
    # gain, scalar gains on every branch, embedding skip into every block, bare lm_head matrix.
    return {
        "model_type": "talkie",
        "architectures": ["TalkieForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "max_position_embeddings": MAX_POS,
        "tie_word_embeddings": False,
    }


def _cfg_solar_open() -> dict:
    # glm4_moe's model: layer 0 dense, layer 1 routed (4 experts, two per token, sigmoid scores
    # with a correction bias, one shared expert).
    return dense("solar_open", "SolarOpenForCausalLM", moe_intermediate_size=32, n_shared_experts=1,
                 n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
                 first_k_dense_replace=1, norm_topk_prob=True, partial_rotary_factor=1.0,
                 tie_word_embeddings=False)


def _cfg_ministral3() -> dict:
    # YaRN RoPE and Llama-4 position-dependent query scaling (1 + beta * log(1 + pos // 8)),
    # a sliding-window layer (8) and a full one.
    return dense("ministral3", "Ministral3ForCausalLM", sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"],
                 rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 2.0,
                                  "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "llama_4_scaling_beta": 0.1},
                 tie_word_embeddings=False)


def _cfg_iquestloopcoder() -> dict:
    # Two loops over the layers: loop 2 mixes (per-head sigmoid gate) attention to loop 1's K/V
    # with windowed attention (8) to its own; 2 * layers caches.
    return dense("iquestloopcoder", "IQuestLoopCoderForCausalLM", loop_num=2, loop_window_size=8,
                 tie_word_embeddings=False)


def _cfg_plamo() -> dict:
    # Parallel attention + MLP off one norm; K/V heads shared by tiling (head i reads KV head
    # i % kv_heads), 2 KV heads for 4 query heads.
    return {
        "model_type": "plamo",
        "architectures": ["PlamoForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "n_shared_head": 2,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _cfg_llama4_text() -> dict:
    # Interleaved RoPE on layers 0-2, NoPE on layer 3, weightless q/k RMS norms, head `output`.
    return dense("llama4_text", "Llama4ForCausalLM", num_hidden_layers=4,
                 intermediate_size_mlp=INTERMEDIATE, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
                 tie_word_embeddings=False)


# bitnet is left out: its BitLinear layers run only as a Metal kernel (no CPU path), so
# neither make_model's check nor mlx-lm's reference can run it here.
CONFIGS = {
    "glm": _cfg_glm,
    "qwen": _cfg_qwen,
    "telechat3": _cfg_telechat3,
    "mimo": _cfg_mimo,
    "nanochat": _cfg_nanochat,
    "baichuan_m1": _cfg_baichuan_m1,
    "youtu_llm": _cfg_youtu_llm,
    "lille-130m": _cfg_lille_130m,
    "mellum": _cfg_mellum,
    "nanbeige": _cfg_nanbeige,
    "phi3small": _cfg_phi3small,
    "talkie": _cfg_talkie,
    "solar_open": _cfg_solar_open,
    "ministral3": _cfg_ministral3,
    "iquestloopcoder": _cfg_iquestloopcoder,
    "plamo": _cfg_plamo,
    "llama4_text": _cfg_llama4_text,
}
# Baichuan-M1's fused q/k/v projection; Talkie's per-head query gain (a q/k norm scale).
QK_WEIGHTS = ("self_attn.W_pack.weight",)
QK_NORMS = ("attn.head_gain.head_g",)
# Tied-embedding final norms: Lille's, Phi-3-small's LayerNorm.
FINAL_NORMS = ("transformer.norm.weight", "model.final_layernorm.weight")
# Refused at load (a clear refusal is allowed, a wrong token is not):
REFUSED = {
    # Each layer's CacheList holds the last raw K/V for a 2-tap conv beside its KV cache, and
    # attention indexes it by hand: no module stores K/V through a plain KV entry.
    "baichuan_m1": "no module of layer 0 stores K/V",
    # Its block-sparse layers add mlx-lm's boolean mask to their scores (+1 / +0): masked keys
    # stay visible, so padded or pooled rows could not match.
    "phi3small": "does not hide the keys a boolean mask hides",
    # The model attends by hand (a second pass reads the first pass's K/V and its own
    # windowed cache, gated): no module stores K/V through its cache.
    "iquestloopcoder": "KV cache entries for 0 layers",
}
