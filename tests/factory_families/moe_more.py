"""Mixture-of-experts decoders: OLMoE, Granite MoE, Qwen2-MoE, Phi-MoE, ERNIE 4.5 MoE, GLM-4 MoE,
dots.llm1, Klear, AFMoE, EXAONE MoE, LFM2-MoE, DBRX, Qwen3.5-MoE (text), MiniMax, Step 3.5,
LongCat-Flash, MiMo-V2-Flash, Ling 2 (bailing_moe_v3), DeepSeek-V3.2, GLM-5 (glm_moe_dsa).
Four experts, two per token, unless said otherwise."""
from __future__ import annotations

from factory_shapes import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, MAX_POS, VOCAB, dense, qwen3_5_text

MOE_WIDTH = 32  # each expert's intermediate width


def _cfg_olmoe() -> dict:
    # q/k RMS norms over all heads (before RoPE), softmax router without renormalising.
    return dense("olmoe", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=False, tie_word_embeddings=False)


def _cfg_granitemoe() -> dict:
    # Granite's multipliers (embedding, attention, residual, logits) with block-sparse experts
    # of width intermediate_size.
    return dense("granitemoe", "GraniteMoeForCausalLM", intermediate_size=MOE_WIDTH,
                 num_local_experts=4, num_experts_per_tok=2, attention_bias=False,
                 embedding_multiplier=2.0, attention_multiplier=1.0 / HEAD_DIM,
                 residual_multiplier=0.5, logits_scaling=4.0, tie_word_embeddings=False)


def _cfg_qwen2_moe() -> dict:
    # Routed experts plus a sigmoid-gated shared expert in every layer, q/k/v biases.
    return dense("qwen2_moe", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=MOE_WIDTH, shared_expert_intermediate_size=64,
                 tie_word_embeddings=False)


def _cfg_phimoe() -> dict:
    # LayerNorms, biased attention and head, sparsemixer routing; plain RoPE (no rope_scaling).
    return dense("phimoe", "PhiMoEForCausalLM", intermediate_size=MOE_WIDTH, num_local_experts=4,
                 num_experts_per_tok=2, rope_scaling=None, original_max_position_embeddings=MAX_POS)


def _cfg_phixtral() -> dict:
    # Phi-2 blocks (parallel attention and MLP, fused Wqkv, partial RoPE, LayerNorms) with a
    # routed MLP of fc1/fc2 experts; its own config spelling (model_dim, num_vocab).
    return {
        "model_type": "phixtral",
        "architectures": ["PhiForCausalLM"],
        "model_dim": HIDDEN,
        "num_heads": HEADS,
        "num_layers": 2,
        "rotary_dim": HEAD_DIM // 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_vocab": VOCAB,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_ernie4_5_moe() -> dict:
    # Layer 0 dense, layer 1 routed (softmax gate with an aux-free correction bias) plus one
    # shared expert.
    return dense("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", use_bias=False, moe_num_experts=4,
                 moe_k=2, moe_layer_start_index=1, moe_intermediate_size=MOE_WIDTH,
                 moe_num_shared_experts=1, moe_use_aux_free=True, tie_word_embeddings=False)


def _cfg_glm4_moe() -> dict:
    # Layer 0 dense, layer 1 routed (sigmoid scores with a correction bias, groups, one shared
    # expert), q/k norms, half-width RoPE.
    return dense("glm4_moe", "Glm4MoeForCausalLM", moe_intermediate_size=MOE_WIDTH, norm_topk_prob=True,
                 n_group=2, topk_group=1, n_shared_experts=1, n_routed_experts=4,
                 routed_scaling_factor=1.5, num_experts_per_tok=2, first_k_dense_replace=1,
                 rope_scaling=None, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                 tie_word_embeddings=False)


def _cfg_dots1() -> dict:
    # deepseek-v3 style routing (sigmoid, correction bias, one shared expert) after a dense
    # layer 0, q/k norms.
    return dense("dots1", "Dots1ForCausalLM", first_k_dense_replace=1, moe_intermediate_size=MOE_WIDTH,
                 n_routed_experts=4, n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2,
                 routed_scaling_factor=1.5, scoring_func="noaux_tc", n_group=1, topk_group=1,
                 tie_word_embeddings=False)


def _cfg_klear() -> dict:
    # Routed experts (with an expert bias) plus shared experts mixed by a learned coefficient;
    # q/k norms; layer 0 dense (mlp_only_layers).
    return dense("Klear", "KlearForCausalLM", attention_bias=False, mlp_only_layers=[0],
                 num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, n_shared_experts=1,
                 moe_intermediate_size=MOE_WIDTH, norm_topk_prob=True, tie_word_embeddings=False)


def _cfg_afmoe() -> dict:
    # Sliding-window layers (8, RoPE) and a global NoPE layer, q/k norms, gated attention,
    # muP embedding scale, layer 0 dense, others routed (sigmoid, one shared expert).
    return dense("afmoe", "AfmoeForCausalLM", num_hidden_layers=4,
                 layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                 moe_intermediate_size=MOE_WIDTH, num_experts=4, num_experts_per_tok=2,
                 num_shared_experts=1, num_dense_layers=1, route_norm=True, route_scale=2.0,
                 score_func="sigmoid", n_group=1, topk_group=1, sliding_window=8, mup_enabled=True,
                 tie_word_embeddings=False)


def _cfg_exaone_moe() -> dict:
    # EXAONE 4 layout (norms after each block, q/k norms) with sliding (8, RoPE) and global
    # (NoPE) layers; layer 0 dense, others routed (sigmoid, correction bias, one shared expert).
    return dense("exaone_moe", "ExaoneMoeForCausalLM", num_hidden_layers=4,
                 moe_intermediate_size=MOE_WIDTH, num_experts=4, num_experts_per_tok=2,
                 num_shared_experts=1, sliding_window=8,
                 layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                 is_moe_layer=[False, True, True, True], routed_scaling_factor=1.5,
                 tie_word_embeddings=False)


def _cfg_lfm2_moe() -> dict:
    # LFM2's short-conv (ArraysCache) and attention layers; layer 0 dense, others routed
    # (sigmoid with an expert bias).
    return {
        "model_type": "lfm2_moe",
        "architectures": ["Lfm2MoeForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_WIDTH,
        "num_hidden_layers": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POS,
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "rope_theta": 10000.0,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "tie_word_embeddings": False,
    }


def _cfg_dbrx() -> dict:
    # Fused Wqkv clipped to +-8, LayerNorms without bias, experts of width 32.
    return {
        "model_type": "dbrx",
        "architectures": ["DbrxForCausalLM"],
        "vocab_size": VOCAB,
        "d_model": HIDDEN,
        "n_layers": 2,
        "n_heads": HEADS,
        "ffn_config": {"ffn_hidden_size": MOE_WIDTH, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "max_seq_len": MAX_POS,
        "tie_word_embeddings": False,
    }


def _cfg_qwen3_5_moe() -> dict:
    # Qwen3.5 MoE text model: Qwen3.5's layers with every MLP routed plus a sigmoid-gated
    # shared expert.
    text_config = qwen3_5_text(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                               decoder_sparse_step=1, moe_intermediate_size=MOE_WIDTH,
                               shared_expert_intermediate_size=MOE_WIDTH, norm_topk_prob=True)
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text_config, "tie_word_embeddings": False, "vocab_size": VOCAB}


def _cfg_minimax() -> dict:
    # MiniMax-M2: q/k RMS norms over all heads, partial RoPE (rotary_dim 8 of 16), sigmoid
    # router with a correction bias, experts of width intermediate_size.
    return dense("minimax", "MiniMaxM2ForCausalLM", intermediate_size=MOE_WIDTH, num_local_experts=4,
                 num_experts_per_tok=2, shared_intermediate_size=0, rotary_dim=8, use_qk_norm=True,
                 scoring_func="sigmoid", tie_word_embeddings=False)


def _cfg_step3p5() -> dict:
    # Step 3.5: sliding layers (8) with more query heads than the full ones (attention_other_setting),
    # zero-centred q/k norms, a per-head sigmoid gate on attention output, partial RoPE on the
    # full layers, layer 0 dense, others routed (sigmoid, scaled) plus a shared expert, clamped
    # SwiGLU on the last layer.
    return {
        "model_type": "step3p5",
        "architectures": ["Step3p5ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "vocab_size": VOCAB,
        "num_attention_heads": HEADS,
        "num_attention_groups": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
        "rms_norm_eps": 1e-5,
        "rope_theta": [10000.0, 10000.0, 10000.0, 10000.0],
        "max_position_embeddings": MAX_POS,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "partial_rotary_factors": [0.5, 1.0, 0.5, 1.0],
        "attention_other_setting": {"num_attention_heads": 2 * HEADS, "num_attention_groups": KV_HEADS},
        "use_head_wise_attn_gate": True,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": MOE_WIDTH,
        "share_expert_dim": MOE_WIDTH,
        "moe_layers_enum": "1,2,3",
        "moe_router_scaling_factor": 2.0,
        "norm_expert_weight": True,
        "swiglu_limits": [0, 0, 0, 7.0],
        "swiglu_limits_shared": [0, 0, 0, 7.0],
        "tie_word_embeddings": False,
    }


def _mla_moe_fields() -> dict:
    # Latent attention (32-wide latent, 8-wide rotary key, low-rank query of 16) shared by the
    # DeepSeek-style families below.
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_WIDTH,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "kv_lora_rank": 32,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _cfg_longcat_flash() -> dict:
    # Two latent-attention blocks per layer (CacheList of two KV caches), two dense MLPs and a
    # shortcut MoE with identity "zero" experts (4 real + 2 zero, two per token).
    return {
        "model_type": "longcat_flash",
        "architectures": ["LongcatFlashForCausalLM"],
        **_mla_moe_fields(),
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "ffn_hidden_size": INTERMEDIATE,
        "moe_topk": 2,
        "expert_ffn_hidden_size": MOE_WIDTH,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "num_layers": 2,
        "routed_scaling_factor": 1.5,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
        "norm_topk_prob": False,
        "router_bias": False,
    }


def _cfg_mimo_v2_flash() -> dict:
    # MiMo-V2-Flash: sliding layers (8, their own RoPE base, twice the KV heads of the full
    # ones, as the real model) and full layers, keys wider than values (24 / 16), attention
    # sinks on both, partial RoPE; layer 0 dense, others routed (sigmoid, correction bias).
    return {
        "model_type": "mimo_v2_flash",
        "architectures": ["MiMoV2FlashForCausalLM"],
        "num_experts_per_tok": 2,
        "hybrid_layer_pattern": [0, 1, 1, 0],
        "moe_layer_freq": [0, 1, 1, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": True,
        "sliding_window_size": 8,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_WIDTH,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "n_shared_experts": None,
        "n_routed_experts": 4,
        "routed_scaling_factor": None,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": MAX_POS,
        "layernorm_epsilon": 1e-5,
        "rope_theta": 1000000.0,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": HEADS,
        "swa_num_key_value_heads": KV_HEADS,
        "head_dim": 24,
        "v_head_dim": 16,
        "swa_head_dim": 24,
        "swa_v_head_dim": 16,
        "partial_rotary_factor": 0.334,
        "attention_value_scale": 0.7,
        "tie_word_embeddings": False,
    }


def _cfg_bailing_moe_v3() -> dict:
    # Ling 2.x (v3): Kimi delta attention layers (short convs, ArraysCache of 4) and MLA
    # layers every layer_group_size (2: layers 1, 3); layer 0 dense, others routed (groups,
    # one shared expert).
    return {
        "model_type": "bailing_moe_v3",
        "architectures": ["BailingMoeV3ForCausalLM"],
        **_mla_moe_fields(),
        "moe_shared_expert_intermediate_size": MOE_WIDTH,
        "num_hidden_layers": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "layer_group_size": 2,
        "head_dim": HEAD_DIM,
        "short_conv_kernel_size": 4,
        "rope_interleave": True,
    }


def _dsa_fields() -> dict:
    # DeepSeek sparse attention: MLA plus a lightning indexer (its own keys, cached beside the
    # latent: CacheList(KVCache, KVCache)) choosing index_topk keys; layer 0 dense.
    return {
        **_mla_moe_fields(),
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 4,
        "num_hidden_layers": 2,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "attention_bias": False,
    }


def _cfg_deepseek_v32() -> dict:
    return {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], **_dsa_fields()}


def _cfg_glm_moe_dsa() -> dict:
    # GLM-5: deepseek_v32's model under GLM's config names (rope_parameters).
    return {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], **_dsa_fields(),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


CONFIGS = {
    "olmoe": _cfg_olmoe,
    "granitemoe": _cfg_granitemoe,
    "qwen2_moe": _cfg_qwen2_moe,
    "phimoe": _cfg_phimoe,
    "phixtral": _cfg_phixtral,
    "ernie4_5_moe": _cfg_ernie4_5_moe,
    "glm4_moe": _cfg_glm4_moe,
    "dots1": _cfg_dots1,
    "Klear": _cfg_klear,
    "afmoe": _cfg_afmoe,
    "exaone_moe": _cfg_exaone_moe,
    "lfm2_moe": _cfg_lfm2_moe,
    "dbrx": _cfg_dbrx,
    "qwen3_5_moe": _cfg_qwen3_5_moe,
    "minimax": _cfg_minimax,
    "step3p5": _cfg_step3p5,
    "longcat_flash": _cfg_longcat_flash,
    "mimo_v2_flash": _cfg_mimo_v2_flash,
    "bailing_moe_v3": _cfg_bailing_moe_v3,
    "deepseek_v32": _cfg_deepseek_v32,
    "glm_moe_dsa": _cfg_glm_moe_dsa,
}
NESTED = {"qwen3_5_moe"}
QK_WEIGHTS = ("Wqkv.weight",)  # DBRX's fused projection
# Refused at load (a clear refusal is allowed, a wrong token is not):
REFUSED = {
    # Two attention blocks per layer, each with its own KV cache (CacheList of two).
    "longcat_flash": "CacheList of several KV caches",
    # The lightning indexer caches its own keys beside the latent (CacheList of two).
    "deepseek_v32": "CacheList of several KV caches .*indexer",
    "glm_moe_dsa": "CacheList of several KV caches .*indexer",
}
