"""Hybrid / recurrent families: RG-LRU, RWKV-7, Mamba + attention mixes, linear attention."""
from __future__ import annotations

from factory_shapes import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, MAX_POS, VOCAB, dense


def _cfg_recurrent_gemma() -> dict:
    # Griffin: RG-LRU recurrent blocks (conv window + scan state in an ArraysCache) and local
    # MQA attention (RotatingKVCache, window 8), gemma norms, sqrt(hidden) embeddings, logit cap.
    return {
        "model_type": "recurrent_gemma",
        "architectures": ["RecurrentGemmaForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 3,
        "intermediate_size": INTERMEDIATE * 2,  # MLP width is intermediate_size // 2
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "attention_bias": False,
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_window_size": 8,
        "block_types": ["recurrent", "attention", "recurrent"],
        "embeddings_scale_by_sqrt_dim": True,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_rwkv7() -> dict:
    # RWKV-7 "Goose": token shift + WKV state per layer (ArraysCache of 3), LoRA gates,
    # value residual from layer 0, LayerNorms, per-head group norm. No attention at all.
    return {
        "model_type": "rwkv7",
        "architectures": ["RWKV7ForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "head_dim": HEAD_DIM,
        "norm_eps": 1e-5,
        "a_low_rank_dim": 16,
        "v_low_rank_dim": 16,
        "gate_low_rank_dim": 16,
        "decay_low_rank_dim": 16,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_jamba() -> dict:
    # Mamba-1 mixers (with dt/B/C RMS norms) and one GQA attention layer (no RoPE); experts
    # (4, two per token) on layers 1 and 3: [mamba, attn+moe, mamba, mamba+moe].
    return {
        "model_type": "jamba",
        "architectures": ["JambaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "attn_layer_offset": 1,
        "attn_layer_period": 4,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_dt_rank": "auto",
        "mamba_proj_bias": False,
        "mamba_conv_bias": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_POS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_plamo2() -> dict:
    # Mamba-2 style SSM layers (dt/B/C RMS norms) alternating with GQA attention (fused qkv,
    # per-head q/k scale vectors after an unweighted RMS norm); offset norms around each block.
    return {
        "model_type": "plamo2",
        "architectures": ["Plamo2ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,  # mamba_step 2: layers 0, 2 mamba; 1, 3 attention
        "rms_norm_eps": 1e-6,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_size_per_head": HEAD_DIM,
        "max_position_embeddings": MAX_POS,
        "attention_window_size": MAX_POS,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_num_heads": 4,
        "mamba_step": 2,
        "mamba_chunk_size": 16,
        "mamba_enabled": True,
        "intermediate_size": INTERMEDIATE,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def _cfg_kimi_linear() -> dict:
    # Kimi Delta Attention (short q/k/v convs + gated delta rule state: ArraysCache of 4) on
    # layers 0, 2; MLA (latent cache, no q LoRA) on 1, 3; layer 0 dense MLP, others routed
    # (4 experts, two per token, sigmoid router with correction bias, one shared expert).
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "intermediate_size": INTERMEDIATE,
        "head_dim": HEAD_DIM,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                               "num_heads": HEADS, "head_dim": HEAD_DIM,
                               "short_conv_kernel_size": 4},
        "model_max_length": MAX_POS,
        "max_position_embeddings": MAX_POS,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_granitemoehybrid() -> dict:
    # Granite 4.0-H: Mamba-2 mixers (gated RMS norm) and RoPE GQA attention, Granite's
    # multipliers (see the core granite config), every MLP routed (4 experts, two per token,
    # softmax over the top-k logits) plus a shared MLP.
    return {
        "model_type": "granitemoehybrid",
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "max_position_embeddings": MAX_POS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "attention_bias": False,
        "embedding_multiplier": 2.0,
        "attention_multiplier": 1.0 / HEAD_DIM,
        "logits_scaling": 8.0,
        "residual_multiplier": 0.5,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "rms_norm_eps": 1e-5,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "position_embedding_type": "rope",
        "rope_theta": 10000.0,
        "time_step_limit": [0.001, 100.0],
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def _bailing_linear_fields() -> dict:
    # Shared by the Ling/Ring linear hybrids: layers 0, 2 linear attention (GLA state in an
    # ArraysCache, RoPE at the attention layers' offset, grouped RMS gate norm), 1, 3 global;
    # q/k norms, half-width RoPE; layer 0 dense, others routed (4 experts in 2 groups, two
    # per token, sigmoid scores with expert bias) plus one shared expert.
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "norm_topk_prob": True,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "layer_group_size": 2,
        "group_norm_size": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": MAX_POS,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "routed_scaling_factor": 2.0,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_bailing_moe_linear() -> dict:
    # Ring-mini-linear-2.0: global layers are GQA with a fused query_key_value.
    return {"model_type": "bailing_moe_linear", "architectures": ["BailingMoeLinearV2ForCausalLM"],
            **_bailing_linear_fields()}


def _cfg_bailing_hybrid() -> dict:
    # Ling/Ring 2.5: global layers are MLA (32-wide latent + 8-wide interleaved rotary key,
    # no q LoRA), cached as latent keys / rotary values. (Architecture BailingMoeV3ForCausalLM
    # would load mlx-lm's bailing_moe_v3 module instead.)
    return {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV2_5ForCausalLM"],
            **_bailing_linear_fields(), "num_key_value_heads": HEADS,
            "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "rope_interleave": True}


def _cfg_olmo_hybrid() -> dict:
    # OLMo hybrid: gated delta-net layers (separate q/k/v short convs, negative eigenvalues
    # allowed; ArraysCache of 4) and one full attention layer (q/k norms over all heads,
    # norms after each block), default pattern: layers 0-2 linear, 3 full.
    return {
        "model_type": "olmo_hybrid",
        "architectures": ["OlmoHybridForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rope_theta": 10000.0,
    }


def _cfg_gemma3n() -> dict:
    # Gemma 3n text model: AltUp (4 streams), LAuReL residual, per-layer token embeddings,
    # sparse top-k GELU on layers 0-1, q/k/v norms, sliding (window 8) and global layers, and
    # KV sharing: layers 2, 3 read the K/V of layers 0, 1 (two cache entries for four layers).
    text_config = {
        "model_type": "gemma3n_text",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16,
        "num_kv_shared_layers": 2,
        "sliding_window": 8,
        "max_position_embeddings": MAX_POS,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
        "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
        "altup_num_inputs": 4,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_active_idx": 0,
        "laurel_rank": 8,
        "tie_word_embeddings": True,
    }
    return {
        "model_type": "gemma3n",
        "architectures": ["Gemma3nForConditionalGeneration"],
        "text_config": text_config,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def _cfg_gemma4_text() -> dict:
    # Gemma 4 (E2B/E4B layout): sliding (window 8, full RoPE) and global layers (twice the head
    # width, proportional partial RoPE), q/k/v norms, per-layer token embeddings, layer scalars,
    # tied embeddings with a logit cap, and KV sharing: layers 2, 3 reuse the K/V of layers
    # 0, 1 (handed over in the forward, no cache entry) with double-wide MLPs.
    return dense("gemma4_text", "Gemma4ForCausalLM", num_hidden_layers=4, rms_norm_eps=1e-6,
                 global_head_dim=2 * HEAD_DIM, global_partial_rotary_factor=0.25,
                 vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                 num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=8,
                 sliding_window_pattern=2, layer_types=["sliding_attention", "full_attention"] * 2,
                 final_logit_softcapping=30.0, attention_k_eq_v=False, enable_moe_block=False,
                 tie_word_embeddings=True)


def _cfg_plamo3() -> dict:
    # PLaMo 3: sliding-window (8; mlx-lm's prefill mask spans window + 1) and full layers
    # (pattern 2: layers 1, 3 full) with separate RoPE bases, fused qkv, offset q/k norms,
    # offset norms before and after each block, tied embeddings.
    return dense("plamo3", "Plamo3ForCausalLM", num_hidden_layers=4, rms_norm_eps=1e-6,
                 sliding_window=8, sliding_window_pattern=2, rope_theta=1000000.0,
                 rope_local_theta=10000.0, tie_word_embeddings=True)


def _cfg_nemotron_nas() -> dict:
    # Nemotron-NAS (Llama-3.x-Nemotron 49B/51B): heterogeneous blocks from block_configs:
    # attention skipped in layer 1 (no cache entry: three entries for four layers), FFN widths
    # from per-layer ffn_mult, layer 2's FFN skipped, layer 3's replaced by one linear layer.
    def block(attn: dict, ffn: dict) -> dict:
        return {"attention": attn, "ffn": ffn}
    gqa = {"n_heads_in_group": HEADS // KV_HEADS}
    return {
        "model_type": "nemotron-nas",
        "architectures": ["DeciLMForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "block_configs": [
            block(gqa, {"ffn_mult": 1.0}),
            block({"no_op": True}, {"ffn_mult": 2.5}),
            block(gqa, {"no_op": True}),
            block(gqa, {"replace_with_linear": True}),
        ],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": MAX_POS,
        "tie_word_embeddings": False,
    }


def _cfg_afm7() -> dict:
    # Apple Foundation Model (on-device, 7th gen): fused qkv (FusedLinear), traditional RoPE
    # before q/k norms, fake 8-bit K/V rounding; the last two layers reuse the last cached
    # layer's K/V (cache.keys_and_values()) with queries only. Always tied embeddings.
    # (mlx-lm reads no architectures field for it; the name is a guess.)
    return {
        "model_type": "afm7",
        "architectures": ["AFMForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_dim": HIDDEN,
        "num_layers": 4,
        "num_kv_reuse_layers": 2,
        "num_heads": HEADS,
        "num_kv_heads": KV_HEADS,
        "hidden_dim_scale_factor": 3.25,
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-5,
    }


CONFIGS = {
    "recurrent_gemma": _cfg_recurrent_gemma,
    "rwkv7": _cfg_rwkv7,
    "jamba": _cfg_jamba,
    "plamo2": _cfg_plamo2,
    "kimi_linear": _cfg_kimi_linear,
    "granitemoehybrid": _cfg_granitemoehybrid,
    "bailing_moe_linear": _cfg_bailing_moe_linear,
    "bailing_hybrid": _cfg_bailing_hybrid,
    "olmo_hybrid": _cfg_olmo_hybrid,
    "gemma3n": _cfg_gemma3n,
    "gemma4_text": _cfg_gemma4_text,
    "plamo3": _cfg_plamo3,
    "nemotron-nas": _cfg_nemotron_nas,
    "afm7": _cfg_afm7,
}
QK_NORMS = ("mixer.q_norm.weight", "mixer.k_norm.weight")  # plamo3 (offset 1: scale 4)
NESTED = {"gemma3n"}
FINAL_NORMS = ("model.language_model.norm.weight", "model.output_norm.weight")  # gemma3n, afm7
# (plamo2's per-head q/k scales, mixer.q_weight / k_weight, are 2-D: the factory's init draws
# them like matrices, and naming them in QK_NORMS would give tree_unflatten the key twice.)
# Refused at load (a clear refusal is allowed, a wrong token is not):
REFUSED = {
    # mlx-lm's prefill mask spans window + 1 while its RotatingKVCache keeps (and decode sees)
    # the window: the runtime windows both by the cache, so one of them would differ.
    "plamo3": "sliding-window mask spans 9 positions in prefill, but its cache keeps 8",
    # The KV-reuse layers rotate their queries by keys.shape[2] - L, the length of the K/V they
    # read back: one host number for every row, where batched decode attends to K/V padded to a
    # common (bucketed) length with rows at their own positions.
    "afm7": "gives RoPE one position for rows at different positions",
}
