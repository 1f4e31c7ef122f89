"""Classic and mid-generation dense decoders (and DeepSeek v1's MoE): GPT-2, GPT-NeoX, GPT-J,
GPTBigCode, Phi, StableLM, Cohere, OLMo 3, InternLM 2/3, OpenELM, MiniCPM3, EXAONE, Helium,
Nemotron, Apertus, Seed-OSS, DeepSeek, and the text paths of the Gemma 3 / Mistral 3 / Llama 4
multimodal wrappers."""
from __future__ import annotations

from factory_shapes import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, MAX_POS, VOCAB, dense


def _cfg_gpt2() -> dict:
    # Learned absolute positions (wpe), fused biased c_attn, MHA, LayerNorms, GELU MLP (4x),
    # always tied (wte.as_linear).
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_ctx": MAX_POS,
        "n_embd": HIDDEN,
        "n_head": HEADS,
        "n_layer": 2,
        "n_positions": MAX_POS,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def _cfg_gpt_neox() -> dict:
    # Fused query_key_value (interleaved per head), quarter-width RoPE, parallel residual
    # (attention and MLP off separate LayerNorms of one input), untied embed_out.
    return {
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "max_position_embeddings": MAX_POS,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_hidden_layers": 2,
        "layer_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "rotary_emb_base": 10000,
        "rotary_pct": 0.25,
        "use_parallel_residual": True,
        "tie_word_embeddings": False,
    }


def _cfg_gptj() -> dict:
    # Parallel attention + MLP off one LayerNorm, interleaved RoPE on the first rotary_dim
    # channels of each head, bias-free q/k/v, biased lm_head.
    return {
        "model_type": "gptj",
        "architectures": ["GPTJForCausalLM"],
        "n_embd": HIDDEN,
        "n_head": HEADS,
        "n_layer": 2,
        "n_positions": MAX_POS,
        "rotary_dim": 8,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_gpt_bigcode() -> dict:
    # StarCoder v1 / SantaCoder: multi-query attention (one K/V head) through a fused c_attn,
    # learned positions, GELU MLP.
    return {
        "model_type": "gpt_bigcode",
        "architectures": ["GPTBigCodeForCausalLM"],
        "n_embd": HIDDEN,
        "n_layer": 2,
        "n_inner": INTERMEDIATE,
        "n_head": HEADS,
        "n_positions": MAX_POS,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": VOCAB,
        "multi_query": True,
        "tie_word_embeddings": False,  # tied, no draw is lively (its c_attn is named as Qwen v1's)
    }


def _cfg_phi() -> dict:
    # Phi-1/1.5/2: parallel attention + MLP off one LayerNorm, partial RoPE (40%), biased
    # projections, a dense output layer, final LayerNorm and biased lm_head.
    return {
        "model_type": "phi",
        "architectures": ["PhiForCausalLM"],
        "max_position_embeddings": MAX_POS,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_hidden_layers": 2,
        "num_key_value_heads": HEADS,
        "partial_rotary_factor": 0.4,
        "intermediate_size": INTERMEDIATE,
        "layer_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _cfg_stablelm() -> dict:
    # StableLM 2: LayerNorms, q/k/v biases, quarter-width RoPE, per-head q/k LayerNorms.
    return dense("stablelm", "StableLmForCausalLM", partial_rotary_factor=0.25, use_qkv_bias=True,
                 layer_norm_eps=1e-5, qk_layernorm=True, use_parallel_residual=False,
                 tie_word_embeddings=False)


def _cfg_cohere() -> dict:
    # Command-R: parallel attention + MLP off one bias-free LayerNorm, interleaved RoPE, per-head
    # q/k LayerNorms, logits scaled by logit_scale, tied embeddings.
    return dense("cohere", "CohereForCausalLM", layer_norm_eps=1e-5, logit_scale=0.5,
                 use_qk_norm=True, tie_word_embeddings=True)


def _cfg_olmo3() -> dict:
    # Sliding-window layers (8) and a full one every fourth, q/k RMS norms over all heads, norms
    # after each block.
    return dense("olmo3", "Olmo3ForCausalLM", num_hidden_layers=4, sliding_window=8,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)


def _cfg_internlm2() -> dict:
    # One fused, grouped wqkv (per KV head: its queries, then k, then v), dynamic-NTK RoPE.
    return dense("internlm2", "InternLM2ForCausalLM", bias=False,
                 rope_scaling={"type": "dynamic", "factor": 2.0}, tie_word_embeddings=False)


def _cfg_internlm3() -> dict:
    # Llama layout (bias-free: transformers refuses qkv_bias != bias), dynamic-NTK RoPE.
    return dense("internlm3", "InternLM3ForCausalLM", qkv_bias=False, bias=False,
                 rope_scaling={"rope_type": "dynamic", "factor": 2.0}, tie_word_embeddings=False)


def _cfg_openelm() -> dict:
    # Layer-wise scaling: query and KV head counts and FFN widths grow with depth (as in the
    # released models); fused qkv_proj, q/k RMS norms, tied embeddings.
    return {
        "model_type": "openelm",
        "architectures": ["OpenELMForCausalLM"],
        "head_dim": HEAD_DIM,
        "num_transformer_layers": 2,
        "model_dim": HIDDEN,
        "vocab_size": VOCAB,
        "ffn_dim_divisor": 16,
        "num_query_heads": [4, 8],
        "num_kv_heads": [2, 4],
        "ffn_multipliers": [1.0, 2.0],
        "ffn_with_glu": True,
        "normalize_qk_projections": True,
        "share_input_output_layers": True,
        "rms_norm_eps": 1e-6,
        "rope_freq_constant": 10000,
        "tie_word_embeddings": True,
    }


def _cfg_minicpm3() -> dict:
    # Multi-head latent attention (q LoRA, 32-wide latent, 8-wide rotary key; full per-head K/V
    # cached), LongRoPE (SuScaled) factors, muP embedding / depth / head scales.
    return dense("minicpm3", "MiniCPM3ForCausalLM", num_key_value_heads=HEADS, dim_model_base=32,
                 q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, kv_lora_rank=32,
                 scale_depth=1.4, scale_emb=4.0,
                 rope_scaling={"type": "longrope", "original_max_position_embeddings": 32,
                               "short_factor": [1.0, 1.5, 2.0, 2.5],
                               "long_factor": [1.0, 2.0, 3.0, 4.0]},
                 tie_word_embeddings=False)


def _cfg_exaone() -> dict:
    # EXAONE 3: Llama layout under its own names (transformer.h, attn.attention), tied.
    return {
        "model_type": "exaone",
        "architectures": ["ExaoneForCausalLM"],
        "hidden_size": HIDDEN,
        "num_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": MAX_POS,
        "tie_word_embeddings": True,
    }


def _cfg_helium() -> dict:
    # Kyutai Helium: Llama layout with every field spelled out.
    return dense("helium", "HeliumForCausalLM", attention_bias=False, mlp_bias=False,
                 tie_word_embeddings=False)


def _cfg_nemotron() -> dict:
    # Nemotron-4 / Minitron: LayerNorm1P (scale 1 + w), half-width RoPE, squared-ReLU MLP
    # without a gate.
    return dense("nemotron", "NemotronForCausalLM", hidden_act="relu2", norm_eps=1e-5,
                 partial_rotary_factor=0.5, tie_word_embeddings=False)


def _cfg_apertus() -> dict:
    # Swiss AI Apertus: xIELU MLP (no gate), q/k RMS norms, pre-norms named attention_/
    # feedforward_layernorm.
    return dense("apertus", "ApertusForCausalLM", mlp_bias=False, attention_bias=False,
                 post_norm=False, qk_norm=True, tie_word_embeddings=False)


def _cfg_seed_oss() -> dict:
    # ByteDance Seed-OSS: Llama layout with q/k/v biases and no o_proj bias.
    return dense("seed_oss", "SeedOssForCausalLM", attention_bias=True, attention_out_bias=False,
                 tie_word_embeddings=False)


def _cfg_deepseek() -> dict:
    # DeepSeek v1 (MoE 16B layout): layer 0 dense, layer 1 routed (4 experts, two per token,
    # softmax scores) plus one shared expert.
    return dense("deepseek", "DeepseekForCausalLM", num_key_value_heads=HEADS,
                 moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
                 num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
                 tie_word_embeddings=False)


def _cfg_gemma3() -> dict:
    # Gemma 3 wrapper (text_config only; the loader drops vision weights): sliding layers (8)
    # and a global one, q/k norms, its own RoPE bases.
    text_config = dense("gemma3_text", "Gemma3ForCausalLM", num_hidden_layers=2, rms_norm_eps=1e-6,
                        sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=HEAD_DIM,
                        rope_local_base_freq=10000.0, rope_theta=1000000.0,
                        tie_word_embeddings=False)  # saved with its lm_head, as gemma3_text
    del text_config["architectures"]
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text_config,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def _cfg_mistral3() -> dict:
    # Mistral 3 (Small 3.1) wrapper: a Llama text model under language_model.
    text_config = dense("mistral", "MistralForCausalLM", tie_word_embeddings=False)
    del text_config["architectures"]
    return {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": text_config,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _cfg_llama4() -> dict:
    # Llama 4 wrapper: chunked attention (ChunkedKVCache) on RoPE layers 0-2, global NoPE layer
    # 3 with temperature tuning, a top-1 routed expert plus shared MLP every second layer. The
    # runtime serves it within one chunk (chunked_attention.py): a chunk of MAX_POS positions.
    text_config = dense("llama4_text", "Llama4ForCausalLM", num_hidden_layers=4, attention_bias=False,
                        attention_chunk_size=MAX_POS, interleave_moe_layer_step=2,
                        intermediate_size_mlp=INTERMEDIATE, num_experts_per_tok=1,
                        num_local_experts=4, rope_scaling=None, use_qk_norm=True,
                        attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1,
                        tie_word_embeddings=False)
    del text_config["architectures"]
    return {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text_config,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


# olmo (v1) is left out: mlx-lm's module exits at import without the ai2-olmo package.
CONFIGS = {
    "gpt2": _cfg_gpt2,
    "gpt_neox": _cfg_gpt_neox,
    "gptj": _cfg_gptj,
    "gpt_bigcode": _cfg_gpt_bigcode,
    "phi": _cfg_phi,
    "stablelm": _cfg_stablelm,
    "cohere": _cfg_cohere,
    "olmo3": _cfg_olmo3,
    "internlm2": _cfg_internlm2,
    "internlm3": _cfg_internlm3,
    "openelm": _cfg_openelm,
    "minicpm3": _cfg_minicpm3,
    "exaone": _cfg_exaone,
    "helium": _cfg_helium,
    "nemotron": _cfg_nemotron,
    "apertus": _cfg_apertus,
    "seed_oss": _cfg_seed_oss,
    "deepseek": _cfg_deepseek,
    "gemma3": _cfg_gemma3,
    "mistral3": _cfg_mistral3,
    "llama4": _cfg_llama4,
}
NESTED = {"gemma3", "mistral3", "llama4"}
# Refused at load (a clear refusal is allowed, a wrong token is not):
REFUSED: dict[str, str] = {}
# GPT-2's fused c_attn (under model.h: Qwen v1's transformer.h.*.attn.c_attn keeps its init);
# OpenELM's q/k norms; final norms of tied embeddings (GPT-2, OpenELM).
QK_WEIGHTS = tuple(f"model.h.{i}.attn.c_attn.weight" for i in range(2))
QK_NORMS = (".attn.q_norm.weight", ".attn.k_norm.weight")
FINAL_NORMS = ("model.ln_f.weight", "transformer.norm.weight")
