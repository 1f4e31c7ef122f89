"""The remaining mlx-lm families with a text-only path: vision-language wrappers built from their
language model's weights (Qwen2/3-VL, Pixtral, LFM2-VL, Kimi-VL / K2.5, Gemma 4), and recent
decoders (Gear, Laguna, Mistral 4, Muse Glimmer, Spark 2.5, Kimi K3, MiniMax-M3-VL,
LongCat-Flash n-gram, DeepSeek V4.1)."""
from __future__ import annotations

from factory_shapes import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, MAX_POS, VOCAB, dense


def _wrap(model_type: str, architecture: str, text_config: dict, **fields) -> dict:
    # A vision-language config whose language model is ``text_config`` (no vision_config).
    text_config = dict(text_config)
    text_config.pop("architectures", None)
    return {"model_type": model_type, "architectures": [architecture], "text_config": text_config,
            "vocab_size": VOCAB, "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
            **fields}


def _cfg_qwen2_vl() -> dict:
    # Qwen2-VL's text path: a Qwen2 decoder (q/k/v biases) under language_model.
    return _wrap("qwen2_vl", "Qwen2VLForConditionalGeneration",
                 dense("qwen2", "Qwen2ForCausalLM", tie_word_embeddings=False))


def _cfg_qwen3_vl() -> dict:
    # Qwen3-VL's text path: a Qwen3 decoder (q/k norms) under language_model.
    return _wrap("qwen3_vl", "Qwen3VLForConditionalGeneration",
                 dense("qwen3", "Qwen3ForCausalLM", tie_word_embeddings=False))


def _cfg_qwen3_vl_moe() -> dict:
    # Qwen3-VL-MoE's text path: Qwen3-MoE (4 experts, two per token, q/k norms); saved with
    # its lm_head, which the wrapper's sanitize requires.
    return _wrap("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
                 dense("qwen3_moe", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32,
                       norm_topk_prob=True, tie_word_embeddings=False))


def _cfg_pixtral() -> dict:
    # Pixtral's text path: a Llama (Mistral) decoder under language_model.
    return _wrap("pixtral", "LlavaForConditionalGeneration",
                 dense("mistral", "MistralForCausalLM", tie_word_embeddings=False))


def _cfg_lfm2_vl() -> dict:
    # LFM2-VL's text path: LFM2 (short-conv layers 0, 2; attention 1, 3), head untied.
    return _wrap("lfm2-vl", "Lfm2VlForConditionalGeneration", {
        "model_type": "lfm2", "hidden_size": HIDDEN, "num_hidden_layers": 4,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POS, "norm_eps": 1e-5, "conv_bias": False,
        "conv_L_cache": 3, "block_dim": HIDDEN, "block_ff_dim": INTERMEDIATE,
        "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "vocab_size": VOCAB, "rope_theta": 10000.0, "tie_word_embeddings": False})


def _mla_text(**fields) -> dict:
    # DeepSeek-V3 text model: latent attention (32-wide latent, 8-wide rotary key), layer 0
    # dense, layer 1 routed (4 experts, two per token, sigmoid with correction bias, 1 shared).
    return {"model_type": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
            "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
            "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "rms_norm_eps": 1e-6,
            "max_position_embeddings": MAX_POS, "rope_theta": 10000.0,
            "tie_word_embeddings": False, **fields}


def _cfg_kimi_vl() -> dict:
    # Kimi-VL's text path: a DeepSeek-V3 decoder under language_model.
    return _wrap("kimi_vl", "KimiVLForConditionalGeneration", _mla_text())


def _cfg_kimi_k25() -> dict:
    # Kimi K2.5's text path: the same DeepSeek-V3 decoder (low-rank query here).
    return _wrap("kimi_k25", "KimiK25ForConditionalGeneration", _mla_text(q_lora_rank=16))


def _cfg_gemma4() -> dict:
    # Gemma 4's text path, 31B-like: sliding (window 8) and global layers of one K/V width,
    # q/k/v norms, no per-layer inputs, no KV sharing, tied embeddings with a logit cap.
    return _wrap("gemma4", "Gemma4ForConditionalGeneration",
                 dense("gemma4_text", "Gemma4ForCausalLM", num_hidden_layers=2, rms_norm_eps=1e-6,
                       global_head_dim=HEAD_DIM, hidden_size_per_layer_input=0,
                       num_kv_shared_layers=0, sliding_window=8, sliding_window_pattern=2,
                       layer_types=["sliding_attention", "full_attention"],
                       final_logit_softcapping=30.0, attention_k_eq_v=False,
                       enable_moe_block=False, tie_word_embeddings=True))


def _cfg_gear() -> dict:
    # Gear: sliding (window 8) and full attention layers, gemma-style norms and MLP, logit cap.
    # No conv_mixer layers: transformers' config check (run when mlx-lm loads the tokenizer)
    # rejects that layer type, so mlx-lm cannot load such a folder here.
    return dense("gear", "GearForCausalLM", rms_norm_eps=1e-6,
                 layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                 final_logit_softcapping=30.0, tie_word_embeddings=False)


def _cfg_laguna() -> dict:
    # Laguna: per-layer-type RoPE (YaRN partial on full layers), sliding (8) and full layers,
    # gated attention, layer 0 dense, layer 1 routed (4 experts, two per token, sigmoid) + shared.
    return dense("laguna", "LagunaForCausalLM", sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"], num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 500000.0,
                                                     "partial_rotary_factor": 0.5}},
                 tie_word_embeddings=False)


def _cfg_mistral4() -> dict:
    # Mistral 4: latent attention (deepseek_v3 style) with a low-rank query, YaRN RoPE and
    # Llama-4 position-dependent query scaling, layer 0 dense, layer 1 routed (4 experts, two
    # per token) plus one shared expert.
    return {"architectures": ["Mistral4ForCausalLM"], **_mla_text(q_lora_rank=16),
            "model_type": "mistral4", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "llama_4_scaling_beta": 0.1}}


def _cfg_muse_glimmer() -> dict:
    # Muse Glimmer: centered RMS norms, sliding (8) and NoPE global layers, q/k scale factor,
    # logit cap and output multiplier.
    return dense("muse_glimmer", "MuseGlimmerForCausalLM", sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)


def _cfg_spark2_5() -> dict:
    # Spark 2.5: sliding (8) and full layers, each with its RoPE, head-wise sigmoid output gate,
    # GELU MLP, tied embeddings.
    return dense("spark2_5", "Spark2_5ForCausalLM", sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"],
                 rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                  "full_attention": {"rope_theta": 1000000.0,
                                                     "partial_rotary_factor": 0.5}},
                 tie_word_embeddings=True)


def _cfg_kimi_k3() -> dict:
    # Kimi K3 (flat config): Kimi delta attention (short conv + gated delta state) on layers
    # 0, 2, NoPE latent attention on 1, 3, SiTU MLPs; layer 0 dense, others routed (4 experts,
    # two per token, sigmoid router, one shared expert).
    return {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": 4, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "intermediate_size": INTERMEDIATE, "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_POS,
        "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                               "num_heads": HEADS, "head_dim": HEAD_DIM,
                               "short_conv_kernel_size": 4},
        "hidden_act": "situ", "activation_situ_beta": 2.0,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "num_experts": 4, "num_experts_per_token": 2,
        "num_shared_experts": 1, "moe_intermediate_size": 32, "routed_scaling_factor": 2.0,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_minimax_m3_vl() -> dict:
    # MiniMax-M3's text path: gemma-style norms, q/k norms, partial RoPE (8 of 16), SwiGLU-OAI
    # experts (4, two per token) plus a shared expert; layer 0 block-sparse attention (an
    # indexer picks 2 of the 4-token key blocks, its keys in a second KV cache), layer 1 full.
    return _wrap("minimax_m3_vl", "MiniMaxM3VLForConditionalGeneration", {
        "model_type": "minimax_m3", "hidden_size": HIDDEN, "intermediate_size": 32,
        "dense_intermediate_size": INTERMEDIATE, "shared_intermediate_size": 32,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": HEAD_DIM,
        "partial_rotary_factor": 0.5, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "mlp_layer_types": ["dense", "sparse"],
        "layer_types": ["minimax_m3_sparse", "full_attention"], "index_n_heads": 2,
        "index_head_dim": HEAD_DIM, "index_block_size": 4, "index_topk_blocks": 2})


def _cfg_longcat_flash_ngram() -> dict:
    # LongCat-Flash with n-gram embeddings (hashed embeddings of the last 4 tokens, their
    # state in an ArraysCache) over longcat_flash's layers (two latent attentions each).
    return {
        "model_type": "longcat_flash_ngram", "architectures": ["LongcatFlashNgramForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "ffn_hidden_size": INTERMEDIATE,
        "expert_ffn_hidden_size": 32, "moe_topk": 2, "n_routed_experts": 4,
        "zero_expert_num": 2, "zero_expert_type": "identity", "num_layers": 2,
        "num_attention_heads": HEADS, "kv_lora_rank": 32, "q_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "routed_scaling_factor": 1.5, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": MAX_POS, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
        "ngram_vocab_size_ratio": 2, "emb_neighbor_num": 3, "emb_split_num": 2,
        "attention_method": "MLA", "tie_word_embeddings": False,
    }


def _cfg_deepseek_v41() -> dict:
    # DeepSeek V4.1: one shared-KV head per layer (64 wide, 8 rotary) with sinks and grouped
    # low-rank output, sliding window 8, hyper-connections (2 streams), routed experts.
    return {
        "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2,
        "num_attention_heads": HEADS, "head_dim": 32, "q_lora_rank": 16,
        "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
        "hc_mult": 2, "max_position_embeddings": MAX_POS, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


CONFIGS = {
    "qwen2_vl": _cfg_qwen2_vl,
    "qwen3_vl": _cfg_qwen3_vl,
    "qwen3_vl_moe": _cfg_qwen3_vl_moe,
    "pixtral": _cfg_pixtral,
    "lfm2-vl": _cfg_lfm2_vl,
    "kimi_vl": _cfg_kimi_vl,
    "kimi_k25": _cfg_kimi_k25,
    "gemma4": _cfg_gemma4,
    "gear": _cfg_gear,
    "laguna": _cfg_laguna,
    "mistral4": _cfg_mistral4,
    "muse_glimmer": _cfg_muse_glimmer,
    "spark2_5": _cfg_spark2_5,
    "kimi_k3": _cfg_kimi_k3,
    "minimax_m3_vl": _cfg_minimax_m3_vl,
    "longcat_flash_ngram": _cfg_longcat_flash_ngram,
    "deepseek_v41": _cfg_deepseek_v41,
}
NESTED = {"qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "pixtral", "lfm2-vl", "kimi_vl", "kimi_k25", "gemma4", "minimax_m3_vl"}
# Left out: muse_spark (its attention, norms and routing run only as Metal kernels, no CPU
# path); bitnet (as in dense_recent: BitLinear runs only as a Metal kernel);
# prism_hadamard_qwen35 (loads only 2-bit Hadamard-rotated packs with a module manifest, not
# float weights).
# Refused at load (a clear refusal is allowed, a wrong token is not):
REFUSED = {
    # The block-sparse layers' indexer caches its own keys beside the layer's (CacheList of two).
    "minimax_m3_vl": "CacheList of several KV caches .*indexer",
    # An n-gram state entry before the layers, then two attentions' KV caches per layer.
    "longcat_flash_ngram": r"3 cache entries \(some a CacheList\) for 2 layers",
    # Its own LayerCache (sliding window, compressed K/V and index state in one object).
    "deepseek_v41": "cache entry 0 is a LayerCache, a cache kind this runtime does not serve",
}
