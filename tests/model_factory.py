"""Tiny random-weight models of real mlx-lm architectures, for tests.

Every model is written as an ordinary model folder (``config.json``,
``model.safetensors`` + index, ``tokenizer.json``, ``tokenizer_config.json``)
that loads through the real ``mlx_lm.load(path)`` / ``mlx_lm.utils.load_model``
code path, fully offline.

Public API::

    build_tokenizer(folder, vocab_size=256)
    make_model(arch, folder, *, dtype="float32", seed=0, **overrides) -> Path
    reference_greedy(folder, prompt_ids, max_tokens) -> list[int]
    ARCHS

Notes
-----
* The tokenizer is a byte-level BPE trained with ``tokenizers`` on a fixed,
  deterministically generated English-ish corpus.  Ids 0 and 1 are the
  specials ``<|endoftext|>`` (EOS) and ``<|pad|>``.  A full byte alphabet
  needs 256 symbols, so with ``vocab_size < 258`` the 13 byte values that can
  never occur in valid UTF-8 (0xC0, 0xC1, 0xF5-0xFF) are left out of the
  alphabet; every Python ``str`` still round-trips through encode/decode.
  With the default 256 this leaves 11 merges, i.e. text is encoded almost
  byte per token.
  The synthetic corpus saturates at ~810 tokens: a larger ``vocab_size``
  gives a model vocab bigger than the tokenizer (like padded real vocabs).
* ``overrides`` update the model config (for nested configs such as
  ``qwen3_5`` they go into ``text_config``).  ``vocab_size`` is also used for
  the tokenizer.  gemma3_text is always saved with an untied ``lm_head``.
* Init: fan-in normal matrices, equal-norm embedding rows, q/k gain 3 (sharp
  attention; a fused qkv projection takes it whole) and, for tied embeddings,
  small embeddings + a scaled final norm.
  Without these, tiny random attention models decode greedily into 1-2 token
  loops.  ``make_model`` also checks (and if needed re-draws, deterministically)
  that greedy decoding of a few prompts is varied.
* Weights are saved in mlx layout with ``mlx_lm.utils.save_model`` and every
  arch's ``sanitize`` is a no-op on that layout (conv1d weights already
  (C, K, 1); qwen3_next/qwen3_5 only shift norms by +1 for HF-layout files),
  so ``load_model`` reproduces the saved tensors exactly.
* Comparisons that expect token-exact agreement with mlx-lm should use
  float32: in bf16, SSM archs (mamba2, nemotron_h) give different logits for
  a whole-prompt prefill and token-by-token decoding, enough to flip argmax.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Union

import factory_families
import mlx.core as mx
import mlx.nn as nn
from factory_shapes import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    MAX_POS,
    VOCAB,
    dense,
    linear_attn_fields,
    qwen3_5_text,
)
from mlx.utils import tree_flatten, tree_unflatten

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)

# Minimal plain-text chat template so chat-style code paths work too.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

_DETERMINERS = ["the", "a", "one", "every", "some", "this", "that", "my", "your", "our"]
_ADJECTIVES = [
    "small", "large", "quick", "lazy", "bright", "dark", "quiet", "loud", "happy",
    "old", "young", "green", "red", "blue", "cold", "warm", "tiny", "strange",
    "clever", "gentle", "brave", "calm", "empty", "heavy", "simple",
]
_NOUNS = [
    "cat", "dog", "bird", "river", "mountain", "city", "teacher", "student",
    "garden", "window", "machine", "house", "forest", "song", "story", "friend",
    "computer", "model", "server", "token", "table", "door", "road", "child",
    "village", "ocean", "letter", "market", "engine", "cloud",
]
_VERBS = [
    "sees", "likes", "finds", "builds", "carries", "follows", "watches", "helps",
    "reads", "writes", "opens", "closes", "paints", "moves", "answers", "visits",
    "remembers", "serves", "generates", "loads",
]
_ADVERBS = [
    "quickly", "slowly", "quietly", "happily", "often", "never", "always",
    "carefully", "suddenly", "again",
]
_PREPOSITIONS = ["near", "under", "over", "behind", "beside", "inside", "across", "with"]
_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent", "Peggy"]


def _synthetic_corpus(n_sentences: int = 3000, seed: int = 1234) -> List[str]:
    """Deterministic English-ish sentences built from small word lists."""
    rng = random.Random(seed)

    def np_() -> str:
        if rng.random() < 0.15:
            return rng.choice(_NAMES)
        words = [rng.choice(_DETERMINERS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_ADJECTIVES))
        words.append(rng.choice(_NOUNS))
        return " ".join(words)

    out = []
    for i in range(n_sentences):
        kind = rng.random()
        subj = np_()
        if kind < 0.45:
            s = f"{subj} {rng.choice(_VERBS)} {np_()}"
        elif kind < 0.7:
            s = f"{subj} {rng.choice(_ADVERBS)} {rng.choice(_VERBS)} {np_()} {rng.choice(_PREPOSITIONS)} {np_()}"
        elif kind < 0.85:
            s = f"{subj} {rng.choice(_VERBS)} {np_()} and {np_()}"
        else:
            s = f"does {np_()} {rng.choice(_VERBS).rstrip('s')} {np_()}"
            s = s[0].upper() + s[1:] + "?"
            out.append(s)
            continue
        s = s[0].upper() + s[1:]
        if rng.random() < 0.2:
            s += f", {rng.randint(0, 999)} times"
        s += rng.choice([".", ".", ".", "!"])
        out.append(s)
    return out


@functools.lru_cache(maxsize=None)
def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2 byte -> printable unicode char mapping (same as tokenizers' ByteLevel)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# Byte values that never appear in valid UTF-8.
_INVALID_UTF8_BYTES = frozenset([0xC0, 0xC1] + list(range(0xF5, 0x100)))


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    n_special = len(SPECIAL_TOKENS)
    b2u = _bytes_to_unicode()
    if vocab_size >= 256 + n_special:
        alphabet = [b2u[b] for b in range(256)]
    else:
        alphabet = [b2u[b] for b in range(256) if b not in _INVALID_UTF8_BYTES]
    if vocab_size < len(alphabet) + n_special:
        raise ValueError(
            f"vocab_size={vocab_size} too small for a byte-level tokenizer "
            f"(needs >= {len(alphabet) + n_special})"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0 and tok.token_to_id(PAD_TOKEN) == 1
    assert tok.get_vocab_size() <= vocab_size
    return tok.to_str(pretty=True)


def build_tokenizer(folder: Union[str, Path], vocab_size: int = 256) -> None:
    """Write tokenizer.json + tokenizer_config.json (+ special_tokens_map.json)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(_tokenizer_json(int(vocab_size)), encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2)
    )


def tokenizer_eos_id(folder: Union[str, Path]) -> int:
    data = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    for t in data["added_tokens"]:
        if t["content"] == EOS_TOKEN:
            return int(t["id"])
    raise KeyError(EOS_TOKEN)


# --------------------------------------------------------------------------
# Model configs
# --------------------------------------------------------------------------

def _cfg_llama() -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
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
        "tie_word_embeddings": False,
    }


def _cfg_qwen3() -> dict:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    }


def _cfg_qwen3_next() -> dict:
    return {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        **linear_attn_fields(),
        # dense MLP everywhere
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0,
        "moe_intermediate_size": 0,
        "mlp_only_layers": [0, 1, 2, 3],
        "norm_topk_prob": True,
        # layers 0,2 linear (gated delta net); 1,3 full attention
        "full_attention_interval": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def _cfg_qwen3_5() -> dict:
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": qwen3_5_text(),
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    }


def _cfg_mamba2() -> dict:
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_heads": 8,
        "head_dim": 16,  # intermediate = num_heads * head_dim = 128
        "intermediate_size": 128,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, 100.0],  # finite: keeps config.json strict JSON
        "time_step_rank": "auto",
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "tie_word_embeddings": True,
    }


def _cfg_nemotron_h() -> dict:
    return {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "hidden_size": HIDDEN,
        "hybrid_override_pattern": ["M", "*", "M", "-"],
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "attention_bias": False,
        "intermediate_size": INTERMEDIATE,
        "mlp_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, 100.0],
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "tie_word_embeddings": False,
    }


def _cfg_gemma3_text() -> dict:
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": HEAD_DIM,
        # layers 0 and 2 are sliding-window (RotatingKVCache), 1 and 3 global.
        "sliding_window": 16,
        "sliding_window_pattern": 2,
    }


def _cfg_gemma2() -> dict:
    # mlx-lm's gemma2 has no sliding-window cache (plain KVCache per layer) and computes
    # attention by hand, with queries grouped 5-D as (B, n_kv_heads, n_rep, L, head_dim).
    return {
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": HEAD_DIM,
    }


def _cfg_phi3() -> dict:
    # One fused qkv_proj (and gate_up_proj); head_dim = hidden_size // heads.
    return {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _cfg_bailing_moe() -> dict:
    # Attention in `attention`: fused query_key_value, output `dense`, q/k norms. Every layer
    # below first_k_dense_replace has a dense MLP: no experts in this tiny model.
    return {
        "model_type": "bailing_moe",
        "architectures": ["BailingMoeForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "first_k_dense_replace": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "use_qk_norm": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _cfg_lfm2() -> dict:
    # Short-conv layers (ArraysCache) and attention layers whose output projection is out_proj.
    return {
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POS,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": HIDDEN,
        "block_ff_dim": INTERMEDIATE,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }


def _cfg_falcon_h1() -> dict:
    # Every layer runs a Mamba mixer and attention side by side: CacheList(ArraysCache, KVCache).
    return {
        "model_type": "falcon_h1",
        "architectures": ["FalconH1ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _mla_fields() -> dict:
    # Multi-head latent attention: a 32-wide latent and an 8-wide rotary key per position;
    # queries of 16 + 8, values of 16. No routed experts: every MLP is dense.
    return {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": 32,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _cfg_deepseek_v2() -> dict:
    # mlx-lm caches full per-head keys (nope + rope: 24 wide) and values (16 wide).
    # Its attention needs a rope_scaling (YaRN, here of factor 1).
    yarn = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": MAX_POS,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0}
    return {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], **_mla_fields(),
            "rope_scaling": yarn}


def _cfg_deepseek_v3() -> dict:
    # mlx-lm caches one latent (32 wide) as keys and the rotary key (8 wide) as values, one head.
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **_mla_fields()}


def _cfg_glm4_moe_lite() -> dict:
    # GLM-4.x MoE-lite: deepseek_v3's latent cache (32-wide latent, 8-wide rotary key) with a
    # low-rank query, layer 0 dense and layer 1 routed (4 experts, two per token, one shared).
    return {"model_type": "glm4_moe_lite", "architectures": ["Glm4MoeLiteForCausalLM"], **_mla_fields(),
            "q_lora_rank": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0}


def _cfg_gpt_oss() -> dict:
    # Sliding-window layers (RotatingKVCache) alternating with full ones; every layer's
    # attention adds a learned per-head sink logit; experts everywhere (4, two per token).
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "sliding_window": 16,
        "rope_theta": 10000,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "tie_word_embeddings": False,
    }


def _cfg_cohere2() -> dict:
    # Layers 0-2 sliding-window with RoPE, layer 3 global without positional encoding;
    # embeddings tied, logits scaled.
    return {
        "model_type": "cohere2",
        "architectures": ["Cohere2ForCausalLM"],
        "hidden_size": HIDDEN,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 4,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "layer_norm_eps": 1e-5,
        "logit_scale": 1.0,
        "sliding_window": 16,
        "sliding_window_pattern": 4,
        "tie_word_embeddings": True,
    }


def _cfg_exaone4() -> dict:
    # Pattern "LLLG": local layers (window, RoPE) and a global one without RoPE; q/k norms.
    return {
        "model_type": "exaone4",
        "architectures": ["Exaone4ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "sliding_window": 16,
        "sliding_window_pattern": "LLLG",
        # What transformers reads (the tokenizer loader parses config.json with it).
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "tie_word_embeddings": False,
    }


_dense = dense


def _cfg_mistral() -> dict:
    # mlx-lm serves "mistral" with its llama module; a null sliding_window as in Mistral v0.2+.
    return _dense("mistral", "MistralForCausalLM", sliding_window=None, tie_word_embeddings=False)


def _cfg_qwen2() -> dict:
    # q/k/v biases, tied embeddings.
    return _dense("qwen2", "Qwen2ForCausalLM", rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True)


def _cfg_qwen3_moe() -> dict:
    # Every layer's MLP is routed: 4 experts of width 32, two per token.
    return _dense("qwen3_moe", "Qwen3MoeForCausalLM", rms_norm_eps=1e-6, num_experts=4,
                  num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                  moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)


def _cfg_mixtral() -> dict:
    # Sparse MoE in every layer: 4 experts of width 64 (intermediate_size), two per token.
    return _dense("mixtral", "MixtralForCausalLM", intermediate_size=64, num_local_experts=4,
                  num_experts_per_tok=2, tie_word_embeddings=False)


def _cfg_gemma() -> dict:
    # Embeddings scaled by sqrt(hidden) and always tied; norms compute x * (1 + weight).
    return _dense("gemma", "GemmaForCausalLM", rms_norm_eps=1e-6)


def _cfg_olmo2() -> dict:
    # q/k RMS norms over all heads together (width heads * head_dim), norms after each block.
    return _dense("olmo2", "Olmo2ForCausalLM", rms_norm_eps=1e-6, tie_word_embeddings=False)


def _cfg_granite() -> dict:
    # Granite 3's multipliers: attention scale 1/head_dim, embeddings, residuals, logits / 8.
    # (Granite's own x12 embeddings and x0.22 residuals, with tied embeddings, let the current
    # token's embedding drown the blocks: greedy decoding repeats tokens for every draw.)
    return _dense("granite", "GraniteForCausalLM", attention_multiplier=1.0 / HEAD_DIM,
                  embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=8.0,
                  attention_bias=False, mlp_bias=False, tie_word_embeddings=True)


def _cfg_minicpm() -> dict:
    # muP-style scales: embeddings x12, residuals x scale_depth / sqrt(layers), logits over
    # hidden / dim_model_base.
    return _dense("minicpm", "MiniCPMForCausalLM", dim_model_base=16, scale_emb=12.0, scale_depth=1.4,
                  tie_word_embeddings=False)


def _cfg_starcoder2() -> dict:
    # LayerNorms with biases, biased projections, a plain GELU MLP (c_fc / c_proj).
    # (bos_token_id: transformers' Starcoder2Config would default it to 50256, past this vocab.)
    return _dense("starcoder2", "Starcoder2ForCausalLM", norm_epsilon=1e-5, tie_word_embeddings=True,
                  bos_token_id=None)


def _cfg_smollm3() -> dict:
    # Llama with NoPE layers: every second layer (here layer 1) has no RoPE.
    return _dense("smollm3", "SmolLM3ForCausalLM", no_rope_layer_interval=2, tie_word_embeddings=True)


def _cfg_glm4() -> dict:
    # Half-width traditional RoPE, q/k/v biases, extra norms after attention and MLP.
    return _dense("glm4", "Glm4ForCausalLM", partial_rotary_factor=0.5, attention_bias=True,
                  tie_word_embeddings=False)


def _cfg_ernie4_5() -> dict:
    return _dense("ernie4_5", "Ernie4_5_ForCausalLM", use_bias=False, tie_word_embeddings=True)


def _cfg_hunyuan() -> dict:
    # Hunyuan-A13B layout: cross-layer attention (layer 1 reuses layer 0's K/V projections),
    # q/k norms after RoPE, NTK-alpha RoPE, 4 experts (two per token) plus a shared MLP.
    return _dense("hunyuan", "HunYuanMoEV1ForCausalLM", intermediate_size=32, attention_bias=False,
                  moe_topk=2, num_experts=4, num_shared_expert=1, use_mixed_mlp_moe=True,
                  use_qk_norm=True, use_cla=True, cla_share_factor=2,
                  rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
                  tie_word_embeddings=True)


def _cfg_hunyuan_v1_dense() -> dict:
    return _dense("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", use_qk_norm=True,
                  rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
                  tie_word_embeddings=True)


def _cfg_mamba() -> dict:
    # Mamba v1: a selective scan per layer, state in an ArraysCache (conv window, SSM state).
    return {
        "model_type": "mamba",
        "architectures": ["MambaForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "state_size": 16,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": "auto",
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


_CONFIGS: Dict[str, Callable[[], dict]] = {
    "llama": _cfg_llama,
    "qwen3": _cfg_qwen3,
    "qwen3_next": _cfg_qwen3_next,
    "qwen3_5": _cfg_qwen3_5,
    "mamba2": _cfg_mamba2,
    "nemotron_h": _cfg_nemotron_h,
    "gemma3_text": _cfg_gemma3_text,
    "gemma2": _cfg_gemma2,
    "phi3": _cfg_phi3,
    "bailing_moe": _cfg_bailing_moe,
    "lfm2": _cfg_lfm2,
    "falcon_h1": _cfg_falcon_h1,
    "deepseek_v2": _cfg_deepseek_v2,
    "deepseek_v3": _cfg_deepseek_v3,
    "glm4_moe_lite": _cfg_glm4_moe_lite,
    "gpt_oss": _cfg_gpt_oss,
    "cohere2": _cfg_cohere2,
    "exaone4": _cfg_exaone4,
    "mistral": _cfg_mistral,
    "qwen2": _cfg_qwen2,
    "qwen3_moe": _cfg_qwen3_moe,
    "mixtral": _cfg_mixtral,
    "gemma": _cfg_gemma,
    "olmo2": _cfg_olmo2,
    "granite": _cfg_granite,
    "minicpm": _cfg_minicpm,
    "starcoder2": _cfg_starcoder2,
    "smollm3": _cfg_smollm3,
    "glm4": _cfg_glm4,
    "ernie4_5": _cfg_ernie4_5,
    "hunyuan": _cfg_hunyuan,
    "hunyuan_v1_dense": _cfg_hunyuan_v1_dense,
    "mamba": _cfg_mamba,
}
_CORE_ARCHS: tuple = tuple(_CONFIGS)
assert not set(_CONFIGS) & set(factory_families.CONFIGS), "a family module redefines a core family"
_CONFIGS.update(factory_families.CONFIGS)
# Families from factory_families/, with no test file of their own (test_more_families_exact).
MORE_ARCHS: tuple = tuple(factory_families.CONFIGS)
# Families the runtime refuses at load, and a pattern its message must match.
REFUSED: Dict[str, str] = dict(factory_families.REFUSED)

ARCHS: tuple = tuple(_CONFIGS)

# Archs whose config nests the language model under "text_config".
_NESTED = {"qwen3_5"} | factory_families.NESTED

_EMBED_STD = 0.25
_EMBED_STD_TIED = 0.02
_TIED_FINAL_NORM = 12.5
# Sharpens attention (q.k logits ~3x a plain fan-in init).  With soft, near-
# uniform attention the context summary converges as the sequence grows and
# greedy decoding falls into short cycles; sharp, RoPE-dependent attention
# acts like a random function of the last few tokens instead.
_QK_GAIN = 3.0

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def make_config(arch: str, **overrides: Any) -> dict:
    """The (tiny) config dict for ``arch`` with overrides applied."""
    if arch not in _CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; supported: {ARCHS}")
    cfg = _CONFIGS[arch]()
    if arch in _NESTED:
        overrides = dict(overrides)
        if "text_config" in overrides:
            cfg["text_config"].update(overrides.pop("text_config"))
        for k in ("architectures", "eos_token_id"):
            if k in overrides:
                cfg[k] = overrides.pop(k)
        cfg["text_config"].update(overrides)
        for k in ("vocab_size", "tie_word_embeddings"):
            cfg[k] = cfg["text_config"][k]
    else:
        cfg.update(overrides)
    return cfg


def _is_tied(cfg: dict) -> bool:
    tc = cfg.get("text_config", cfg)
    model_type = tc.get("model_type", cfg["model_type"])
    if model_type.startswith("gemma3") and not model_type.startswith("gemma3n"):
        return False  # gemma3_text ties only when lm_head.weight is absent (gemma3n always ties)
    return bool(tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))


def _vocab_size(cfg: dict) -> int:
    return int(cfg.get("text_config", cfg)["vocab_size"])


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


# Names of the final (pre-lm_head) norm scale, per weight layout (once each: family modules may
# name the same one).
_FINAL_NORMS = tuple(dict.fromkeys(("model.norm.weight", "backbone.norm_f.weight", "language_model.model.norm.weight",
                                    "model.embedding_norm.weight", *factory_families.FINAL_NORMS)))

_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.q_layernorm.weight",
             "self_attn.k_layernorm.weight", "attention.query_layernorm.weight", "attention.key_layernorm.weight",
             *factory_families.QK_NORMS)
# Projections that make queries and keys (fused ones make values too: they get the gain as well).
_QK_WEIGHTS = ("q_proj.weight", "k_proj.weight", "qkv_proj.weight", "query_key_value.weight",
               "kv_a_proj_with_mqa.weight", "embed_q.weight", *factory_families.QK_WEIGHTS)


def _init_weights(
    model: nn.Module, seed: int, tied: bool, gemma_norms: bool = False
) -> None:
    """Deterministic random init of all matrices (Linear / Embedding / conv).

    1-D parameters (norm scales, biases, SSM dt_bias / A_log / D) keep the
    model's own initialisation (norms at identity etc.), which is
    deterministic given ``mx.random.seed(seed)`` before construction; the
    exceptions are q/k norm scales (attention gain) and the final norm of
    tied-embedding models (logit spread), see below.
    """
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), max(len(params), 1))
    qk_norm = any(n.endswith(_QK_NORMS) for n, _ in params)
    new = []
    for i, (name, p) in enumerate(params):
        if p.ndim < 2 or (qk_norm and name.endswith(_QK_NORMS)):
            continue  # (2-D q/k norm scales, Cohere's per-head LayerNorms, are set below)
        w = mx.random.normal(p.shape, key=keys[i])
        if "embed" in name:
            # Equal-norm rows, so that with tied embeddings (logit_j = h . E_j)
            # no token is favoured just for having a long embedding.
            w = w * (w.shape[-1] ** 0.5) / mx.linalg.norm(w, axis=-1, keepdims=True)
            # With tied embeddings the current token's own embedding, left in
            # the residual stream, scores e_cur . e_cur against every other
            # token: it must be small next to what the blocks (which see
            # normalised inputs) add, or greedy decoding repeats tokens.
            std = _EMBED_STD_TIED if tied else _EMBED_STD
        elif "conv1d" in name:
            std = 0.5  # depthwise conv over the kernel taps
        else:
            std = 1.0 / (p.shape[-1] ** 0.5)  # fan-in scaling
            if name.endswith(_QK_WEIGHTS) and not qk_norm:
                std *= _QK_GAIN
        new.append((name, (w * std).astype(p.dtype)))
    for i, (name, p) in enumerate(params):
        if name.endswith("self_attn.sinks"):
            # gpt-oss's per-head sink logits start at zero: draw them, so that tests see them.
            new.append((name, mx.random.normal(p.shape, key=keys[i]).astype(p.dtype)))
    if qk_norm:
        # q/k are RMS-normalised: the gain goes into the norm scales instead
        # (gemma's RMSNorm computes x * (1 + weight)).
        value = _QK_GAIN - 1.0 if gemma_norms else _QK_GAIN
        for name, p in params:
            if name.endswith(_QK_NORMS):
                new.append((name, mx.full(p.shape, value, p.dtype)))
    if tied:
        # Small tied embeddings make flat logits; scaling the final norm
        # (a per-channel constant) spreads them without changing the argmax.
        flat = dict(params)
        for n in _FINAL_NORMS:
            if n in flat:
                new.append((n, mx.full(flat[n].shape, _TIED_FINAL_NORM, flat[n].dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    pred = getattr(model, "cast_predicate", None)
    if not callable(pred):
        pred = lambda _: True  # noqa: E731
    params = tree_flatten(model.parameters())
    model.update(
        tree_unflatten(
            [
                (k, v.astype(dtype) if (mx.issubdtype(v.dtype, mx.floating) and pred(k)) else v)
                for k, v in params
            ]
        )
    )
    mx.eval(model.parameters())


_CHECK_PROMPTS = (
    "The quick brown fox jumps over",
    "Alice sees a small cat.",
    "hello",
    "Q: what is 2 + 2?\nA:",
    "def main():\n    print('hi')",
    "Über café, naïve 日本語 🙂",
)


def _fast_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(int(vocab_size)))


def _is_lively(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    n_tokens: int = 30,
    min_distinct: int = 8,
) -> bool:
    """Greedy continuations of a few ordinary prompts are varied and finite."""
    logits = model(mx.array([list(prompts[0])]))
    if bool(mx.any(mx.isnan(logits)).item()):  # -inf is allowed: Phi-3-small masks unused ids so
        return False
    for p in prompts:
        if len(set(greedy_tokens(model, p, n_tokens))) < min_distinct:
            return False
    return True


def make_model(
    arch: str,
    folder: Union[str, Path],
    *,
    dtype: str = "float32",
    seed: int = 0,
    check: bool = True,
    max_attempts: int = 64,
    **overrides: Any,
) -> Path:
    """Build a tiny random ``arch`` model folder loadable by ``mlx_lm.load``.

    Weights are a deterministic function of ``seed``.  With ``check`` (default)
    the init is re-drawn (from seeds derived from ``seed``) until greedy decoding
    is "lively": 30 greedy tokens from each of a few fixed prompts contain >= 8
    distinct ids (with the init below the first draw nearly always passes).
    """
    from mlx_lm.utils import _get_classes, save_config, save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")

    cfg = make_config(arch, **overrides)
    vocab_size = _vocab_size(cfg)
    build_tokenizer(folder, vocab_size=vocab_size)
    eos_id = tokenizer_eos_id(folder)
    cfg.setdefault("eos_token_id", eos_id)
    cfg.setdefault("pad_token_id", 1)
    cfg["torch_dtype"] = dtype

    model_class, args_class = _get_classes(cfg)
    tokenizer = _fast_tokenizer(vocab_size)
    check_prompts = [tokenizer.encode(p).ids for p in _CHECK_PROMPTS]
    for attempt in range(max_attempts):
        # Attempt 0 uses `seed` itself; later attempts derive new seeds from it,
        # so the result is still a pure function of (arch, config, dtype, seed).
        s = seed if attempt == 0 else (seed * 1_000_003 + attempt * 7919) % (2**31)
        mx.random.seed(s)
        model = model_class(args_class.from_dict(copy.deepcopy(cfg)))
        _init_weights(model, s, tied=_is_tied(cfg), gemma_norms=arch.startswith("gemma"))
        _cast(model, _DTYPES[dtype])
        if not check or _is_lively(model, check_prompts):
            break
    else:
        raise RuntimeError(
            f"{arch}: no non-degenerate random init found in {max_attempts} attempts"
        )

    save_model(folder, model)
    save_config(copy.deepcopy(cfg), folder / "config.json")
    return folder


# --------------------------------------------------------------------------
# Reference generation
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _load_cached(folder: str, _stamp: tuple):
    from mlx_lm import load

    model, tokenizer = load(folder)
    return model, tokenizer


def _stamp(folder: Path) -> tuple:
    return tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size)
        for f in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors"))
    )


def load_cached(folder: Union[str, Path]):
    """``mlx_lm.load(folder)`` memoised per folder (and its files' mtimes, so a
    model rebuilt in the same folder is reloaded)."""
    folder = Path(folder).resolve()
    return _load_cached(str(folder), _stamp(folder))


def greedy_tokens(model: nn.Module, prompt_ids: Sequence[int], max_tokens: int) -> List[int]:
    """mlx-lm greedy tokens via ``generate_step`` (no EOS stopping)."""
    from mlx_lm.generate import generate_step

    out: List[int] = []
    if max_tokens <= 0:
        return out
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    for tok, _ in generate_step(
        prompt, model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        out.append(int(tok))
    return out


# mlx-lm's greedy continuations already computed, per (folder, its files' stamp, prompt): the
# longest one asked for (greedy decoding is prefix-stable: fewer tokens are its first ones).
_REFERENCES: Dict[tuple, List[int]] = {}


def reference_greedy(
    folder: Union[str, Path], prompt_ids: Sequence[int], max_tokens: int
) -> List[int]:
    """Load (cached per folder) and return mlx-lm's greedy continuation (memoised: tests
    that run one prompt on several paths compute it once)."""
    folder = Path(folder).resolve()
    key = (str(folder), _stamp(folder), tuple(int(t) for t in prompt_ids))
    known = _REFERENCES.get(key)
    if known is None or len(known) < max_tokens:
        model, _ = load_cached(folder)
        known = _REFERENCES[key] = greedy_tokens(model, prompt_ids, max_tokens)
    return list(known[:max(max_tokens, 0)])


def with_chat_template(src: Union[str, Path], dst: Union[str, Path], template: str) -> Path:
    """Copy the model folder ``src`` to ``dst`` with ``template`` as its chat template."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


__all__ = [
    "ARCHS",
    "MORE_ARCHS",
    "REFUSED",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "build_tokenizer",
    "make_config",
    "make_model",
    "reference_greedy",
    "greedy_tokens",
    "load_cached",
    "tokenizer_eos_id",
    "with_chat_template",
]
