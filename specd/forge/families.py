"""Tiny random-weight models of every mlx-lm model family the engine serves.

Each ``FAMILIES`` entry is the config.json of a real checkpoint of that family
(its keys and nesting: ``text_config`` for the multimodal wrappers,
``rope_scaling`` / ``rope_parameters`` as the family spells them) shrunk to a
64-wide toy that still mixes every layer and cache kind the real model does.
Sliding windows (8 tokens) and Llama 4's attention chunks (16) are small, so
a 40-80 token request wraps them. Every vocabulary is the forge test
tokenizer's, so any sampled id decodes.

Every other family the installed mlx-lm ships (``model_types``) gets a config
built from its ``ModelArgs`` (``family_config``): ``TINY`` sizes for the
fields it has, then its ``SHAPES`` entry, so a family mlx-lm adds is built
and tested without a hand-written config; ``NOT_SERVED``, ``METAL_ONLY`` and
``UNFORGEABLE`` say which cannot be, and why.

``build`` goes through mlx-lm's own machinery (model lookup, ``sanitize``,
``quantize_model``, ``save_model``, ``save_config``), so a built directory
loads with ``mlx_lm.load`` exactly like an mlx-community checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import io
import json
import math
import pkgutil
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

from .llama import TOKENIZER_FILES
from .presets import get_recipe
from .tokenizer import EOS, IM_END, SPECIAL_TOKENS

__all__ = [
    "FAMILIES", "METAL_ONLY", "NOT_SERVED", "SHAPES", "UNFORGEABLE", "VOCAB_SIZE", "EOS_TOKEN_IDS", "WINDOW",
    "CHUNK", "LOGIT_STD", "build", "family_config", "make_model", "model_types", "served_families",
]

VOCAB_SIZE = get_recipe("test").vocab_size
EOS_TOKEN_IDS = [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)]
WINDOW = 8  # sliding-window size of every family with sliding layers
CHUNK = 16  # Llama 4's attention_chunk_size

# Greedy decoding must not hinge on float noise: logits get a std of about
# LOGIT_STD, so the top-1/top-2 gap is rarely below 1e-3.
LOGIT_STD = 4.0

# Keys every family shares; each entry below adds its own on top.
_COMMON = {"vocab_size": VOCAB_SIZE, "torch_dtype": "float32"}
_TOKENS = {"bos_token_id": None, "eos_token_id": EOS_TOKEN_IDS, "pad_token_id": EOS_TOKEN_IDS[0]}
_ATTN = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}

_SLIDING_FULL_4 = ["sliding_attention"] * 3 + ["full_attention"]
_LINEAR_FULL_4 = ["linear_attention"] * 3 + ["full_attention"]
_YARN = {"beta_fast": 32.0, "beta_slow": 1.0, "rope_type": "yarn"}
# DeepSeek-style routing (DeepSeek V3, GLM-4.5, Nemotron-H): grouped top-k over routed experts plus a shared one
_ROUTED_MOE = {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
               "topk_group": 1, "norm_topk_prob": True}
# A small Mamba-2 mixer, as Granite 4 (granitemoehybrid) and Falcon-H1 name its settings
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
           "mamba_n_groups": 1}
# Gemma 3: five sliding-window layers per global one, each with its own rope base.
_GEMMA3 = {
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "intermediate_size": 128,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": WINDOW,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6,
}
# Llama 3.1 and Llama 4: the llama3 RoPE scaling of an 8k original window.
_LLAMA3_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
# Qwen3 and its MoE: q/k-normed attention.
_QWEN3 = {
    **_ATTN,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "hidden_act": "silu",
    "attention_bias": False,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
}
# Qwen3-Next and Qwen3.5: three gated-delta-net layers, then full attention.
_GATED_DELTA = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": _LINEAR_FULL_4,
    "full_attention_interval": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "attention_bias": False,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
}
_QWEN3_5_ROPE = {
    "rope_type": "default",
    "mrope_interleaved": True,
    "mrope_section": [2, 1, 1],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000.0,
}

FAMILIES: dict[str, dict] = {
    # Llama 3.1 8B: llama3 rope scaling, untied head.
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "tie_word_embeddings": False,
    },
    # Mistral 7B v0.3 (mlx-lm runs it as llama); no sliding window.
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # Ministral 3 text model: yarn rope plus Llama 4 style position-dependent
    # query scaling (original_max_position_embeddings shrunk so it steps at 32).
    "ministral3": {
        "architectures": ["Ministral3ForCausalLM"],
        "model_type": "ministral3",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            **_YARN,
            "factor": 16.0,
            "llama_4_scaling_beta": 0.1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 1000000000.0,
            "type": "yarn",
        },
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # Mistral Small 3.1: a mistral text model under text_config (vision dropped,
    # as mlx_lm.convert drops it).
    "mistral3": {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "torch_dtype": "float32",
        **_TOKENS,
        "image_token_index": 10,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "text_config": {
            "model_type": "mistral",
            **_COMMON, **_ATTN,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    },
    # Qwen2.5 7B: biased q/k/v, sliding window configured but unused.
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    # Qwen3 8B: q/k norms.
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_COMMON, **_TOKENS, **_QWEN3,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    # Qwen3 30B-A3B: every layer a top-k routed MoE.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_COMMON, **_TOKENS, **_QWEN3,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    # Qwen3-Next 80B-A3B: three gated-delta linear-attention layers per gated
    # full-attention layer, MoE with a gated shared expert.
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        **_COMMON, **_TOKENS, **_GATED_DELTA,
        "partial_rotary_factor": 0.25,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rope_theta": 10000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    # OLMo Hybrid 7B: three gated-delta linear-attention layers (short convs
    # on q, k and v, negative eigenvalues allowed) per full-attention layer
    # with q/k norms and no RoPE, post-norm blocks.
    "olmo_hybrid": {
        "architectures": ["OlmoHybridForCausalLM"],
        "model_type": "olmo_hybrid",
        **_COMMON, **_TOKENS,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": _LINEAR_FULL_4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 12,
        "linear_value_head_dim": 24,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_parameters": None,
        "rope_theta": None,
        "tie_word_embeddings": False,
    },
    # Qwen3.5 (dense): the Qwen3-Next layer mix under text_config, rope under
    # rope_parameters.
    "qwen3_5": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        **_TOKENS,
        "image_token_id": 10,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text",
            **_COMMON,
            **_GATED_DELTA,
            "intermediate_size": 128,
            "rope_parameters": _QWEN3_5_ROPE,
            "tie_word_embeddings": False,
        },
    },
    # Qwen3.5 MoE (35B-A3B): as qwen3_5, every MLP a MoE with shared expert.
    "qwen3_5_moe": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        **_TOKENS,
        "image_token_id": 10,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            **_COMMON,
            **_GATED_DELTA,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": _QWEN3_5_ROPE,
            "tie_word_embeddings": False,
        },
    },
    # Phi-3.5 mini: fused qkv and gate_up projections, longrope scaling.
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        **_COMMON, **_TOKENS,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
            "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3],
        },
        "sliding_window": 262144,
        "tie_word_embeddings": False,
    },
    # Gemma 3 1B: five sliding-window layers per global layer, tied head.
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_COMMON, **_TOKENS, **_GEMMA3,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_scaling": None,
        "max_position_embeddings": 32768,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    },
    # Gemma 3 4B: gemma3_text under text_config (vision dropped), linear rope
    # scaling on the global layers, vocab_size at the top level.
    "gemma3": {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        **_COMMON, **_TOKENS,
        "boi_token_index": 3,
        "eoi_token_index": 4,
        "image_token_index": 5,
        "mm_tokens_per_image": 256,
        "text_config": {
            "model_type": "gemma3_text",
            "vocab_size": VOCAB_SIZE,
            **_GEMMA3,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "max_position_embeddings": 131072,
        },
    },
    # Gemma 4 E2B text model: sliding and (wider-headed, proportional-rope)
    # global layers, per-layer input embeddings, and KV sharing: the last two
    # layers reuse earlier layers' keys/values and get no cache of their own.
    "gemma4_text": {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        **_COMMON, **_TOKENS,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "layer_types": [
            "sliding_attention", "sliding_attention", "full_attention",
            "sliding_attention", "sliding_attention", "full_attention",
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": None,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 2,
        "intermediate_size": 128,
        "use_double_wide_mlp": True,
        "enable_moe_block": False,
        "hidden_size_per_layer_input": 64,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": WINDOW,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "tie_word_embeddings": True,
    },
    # gpt-oss 20B: alternating sliding/full attention with sinks, biased
    # projections, top-k MoE with the clamped swiglu.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "initial_context_length": 4096,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            **_YARN,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "router_aux_loss_coef": 0.9,
        "tie_word_embeddings": False,
    },
    # OLMo 3 7B: three sliding-window layers per full layer, post-norm blocks,
    # yarn rope on the full layers.
    "olmo3": {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        **_COMMON, **_TOKENS,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": _SLIDING_FULL_4,
        "sliding_window": WINDOW,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000,
        "rope_scaling": {
            **_YARN,
            "attention_factor": 1.2079441541679836,
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
    },
    # DeepSeek V3: multi-head latent attention (low-rank q and kv), a dense
    # first layer then sigmoid-routed grouped MoE with a shared expert.
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **_COMMON, **_TOKENS,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        **_ROUTED_MOE,
        "n_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "tie_word_embeddings": False,
    },
    # DeepSeek V4.1 (Flash): under text_config, hyper-connection streams,
    # grouped low-rank output, a sliding window on every layer and, on the
    # others, KV compressed 4 tokens to one latent: a layer that compresses
    # and indexes its own, one that reuses it with its own indexer (top-k
    # within candidate blocks), one that compresses its own and reuses the
    # other's top-k. sqrt-softplus-routed MoE with a shared expert.
    "deepseek_v41": {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        **_TOKENS,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "deepseek_v41_text",
            **_COMMON,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "head_dim": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "o_groups": 2,
            "o_lora_rank": 16,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-6,
            "sliding_window": WINDOW,
            "compress_ratios": [0, 4, 4, 4],
            "kv_source_layer_ids": [1, 3],
            "index_source_layer_ids": [1, 2],
            "candidate_source_layer_id": 1,
            "candidate_topk_blocks": 2,
            "candidate_block_size": 2,
            "index_n_heads": 2,
            "index_head_dim": 32,
            "index_topk": 4,
            "compress_rope_theta": 160000.0,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "max_position_embeddings": 1048576,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 3,  # checkpoints run 20: the same ops, a tiny model's step a third shorter
            "hc_eps": 1e-6,
            "num_nextn_predict_layers": 3,
            "tie_word_embeddings": False,
        },
    },
    # GLM-4.5 Air: partial rope, biased q/k/v, a dense first layer then
    # sigmoid-routed MoE with a shared expert.
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 2,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": False,
        "attention_bias": True,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        **_ROUTED_MOE,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    # LFM2 350M: gated short-convolution layers around attention layers.
    "lfm2": {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        **_COMMON, **_TOKENS,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "full_attn_idxs": [2],
        "num_attention_heads": 4,
        "num_heads": 4,
        "num_key_value_heads": 2,
        "conv_L_cache": 3,
        "conv_bias": False,
        "conv_dim": 64,
        "conv_dim_out": 64,
        "block_dim": 64,
        "block_ff_dim": 192,
        "block_multiple_of": 64,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "block_use_swiglu": True,
        "block_norm_eps": 1e-5,
        "norm_eps": 1e-5,
        "max_position_embeddings": 128000,
        "rope_theta": 1000000.0,
        "tie_embedding": True,
        "tie_word_embeddings": True,
    },
    # Granite 4.0 H Tiny: Mamba-2 layers around a NoPE attention layer, each
    # followed by a routed MoE plus a shared MLP; muP multipliers, tied head.
    "granitemoehybrid": {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "mamba", "attention", "mamba"],
        "position_embedding_type": "nope",
        "attention_bias": False,
        **_MAMBA2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "intermediate_size": 64,
        "shared_intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0625,
        "residual_multiplier": 0.22,
        "logits_scaling": 6.0,
        "max_position_embeddings": 131072,
        "normalization_function": "rmsnorm",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
    # Nemotron 3 Nano: Mamba-2, attention (no rope) and MoE blocks in one
    # stack; only Mamba and attention blocks have a cache.
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        **_COMMON, **_TOKENS, **_ATTN,
        "hybrid_override_pattern": "MEM*E",
        "num_hidden_layers": 5,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "expand": 2,
        "chunk_size": 128,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 128,
        **_ROUTED_MOE,
        "routed_scaling_factor": 2.5,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 262144,
        "residual_in_fp32": False,
        "time_step_limit": [0.0, math.inf],
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "tie_word_embeddings": False,
    },
    # Falcon-H1: every layer runs Mamba-2 and attention side by side, so each
    # layer's cache is a CacheList(ArraysCache, KVCache).
    "falcon_h1": {
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        **_COMMON, **_TOKENS, **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "attention_bias": False,
        "mamba_d_ssm": 128,
        **_MAMBA2,
        "mamba_chunk_size": 128,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_rms_norm": False,
        "mamba_norm_before_gate": False,
        "mamba_use_mlp": True,
        "projectors_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "embedding_multiplier": 5.656854249492381,
        "lm_head_multiplier": 0.0390625,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.9375,
        "key_multiplier": 0.390625,
        "ssm_in_multiplier": 1.25,
        "ssm_out_multiplier": 0.23570226039551587,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    # Llama 4 Scout layout: three chunked-attention rope layers per global
    # NoPE layer (temperature-tuned queries; floor_scale shrunk to 16 so the
    # tuning steps within a short request), MoE on every second layer.
    "llama4": {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "torch_dtype": "float32",
        **_TOKENS,
        "boi_token_index": 3,
        "eoi_token_index": 4,
        "image_token_index": 5,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama4_text",
            **_COMMON, **_ATTN,
            "num_hidden_layers": 4,
            "attention_chunk_size": CHUNK,
            "no_rope_layers": [1, 1, 1, 0],
            "use_qk_norm": True,
            "attn_temperature_tuning": True,
            "floor_scale": 16,
            "attn_scale": 0.1,
            "attention_bias": False,
            "interleave_moe_layer_step": 2,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "hidden_act": "silu",
            "max_position_embeddings": 10485760,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": _LLAMA3_ROPE,
            "tie_word_embeddings": False,
        },
    },
}


# -- every other family mlx-lm ships: a tiny config built from its ModelArgs -----------

# The sizes a generated tiny model takes, by the names mlx-lm's ModelArgs use for them.
TINY = {
    "num_vocab": VOCAB_SIZE,  # Phixtral's name for vocab_size (which _COMMON sets)
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "hidden_dim": 64, "model_dim": 64,
    "intermediate_size": 128, "ffn_hidden_size": 128, "n_inner": 128, "ff_intermediate_size": 128,
    "moe_intermediate_size": 64, "expert_ffn_hidden_size": 64, "shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "num_transformer_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "norm_eps": 1e-6,
    "layernorm_epsilon": 1e-6,
    "max_position_embeddings": 32768, "n_positions": 32768, "n_ctx": 32768, "rope_theta": 10000.0,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "moe_top_k": 2,
    "num_experts_per_tok": 2, "moe_topk": 2,
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_window_size": WINDOW,
    # multi-head latent attention (DeepSeek V2 and its followers)
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
}
_MOE_SHARED = {"n_shared_experts": 1, "norm_topk_prob": True, "first_k_dense_replace": 1}
_GRANITE = {"logits_scaling": 8.0, "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22, "attention_bias": False}

# Per family, what its real checkpoints set that a generated tiny model must keep (layer
# mixes, MoE routing, MLA ranks, multipliers) and the fields its ModelArgs requires.
SHAPES: dict[str, dict] = {
    "Klear": {"attention_bias": False, "mlp_only_layers": [], "decoder_sparse_step": 1, **_MOE_SHARED},
    "afm7": {"num_kv_reuse_layers": 1},
    "afmoe": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL_4, "num_dense_layers": 1},
    "cohere2": {"num_hidden_layers": 4},
    "exaone4": {"num_hidden_layers": 4, "sliding_window_pattern": "LLLG", "layer_types": _SLIDING_FULL_4,
                "rope_scaling": _LLAMA3_ROPE},
    "exaone_moe": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL_4, "is_moe_layer": [False, True, True, True],
                   "num_shared_experts": 1},
    "gear": {"layer_types": ["sliding_attention", "full_attention"]},
    "mellum": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL_4, "norm_topk_prob": True,
               "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                                   "full_attention": {"rope_theta": 1000000.0}}},
    "kimi_linear": {"num_hidden_layers": 4, "model_max_length": 32768,
                    "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4,
                                           "head_dim": 16, "short_conv_kernel_size": 4}},
    "longcat_flash": {"attention_bias": False, "attention_method": "MLA", "zero_expert_type": "identity",
                      "zero_expert_num": 2, "routed_scaling_factor": 6.0, "mla_scale_q_lora": True,
                      "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"zero_expert_num": 2, "routed_scaling_factor": 6.0, "mla_scale_q_lora": True,
                            "mla_scale_kv_lora": True},
    "mimo_v2_flash": {"num_hidden_layers": 4, "hybrid_layer_pattern": [0, 1, 1, 1], "moe_layer_freq": [0, 1, 1, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "n_shared_experts": None, "routed_scaling_factor": None, "topk_method": "noaux_tc",
                      "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                      "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                      "v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16, "partial_rotary_factor": 0.5},
    "apertus": {"mlp_bias": False, "attention_bias": False, "post_norm": False, "qk_norm": True},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2},
    # Gemma 3n (E2B): AltUp streams, LAuReL, per-layer inputs, KV shared by the last layers,
    # activation sparsity on the first; four sliding layers per global one.
    "gemma3n": {"text_config": {"num_hidden_layers": 10, "num_kv_shared_layers": 4,
                                "vocab_size_per_layer_input": VOCAB_SIZE, "rope_local_base_freq": 10000.0,
                                "rope_theta": 1000000.0, "final_logit_softcapping": 30.0,
                                "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
                                "activation_sparsity_pattern": [0.95] * 2 + [0.0] * 8,
                                "hidden_size_per_layer_input": 16, "altup_num_inputs": 4, "altup_coef_clip": 120.0,
                                "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 8}},
    "muse_spark": {"text_config": {"num_hidden_layers": 4, "post_norm_eps": 1e-6,
                                   "rope_parameters": {"rope_theta": 500000.0},
                                   "layer_rope_theta": [10000.0, 10000.0, 10000.0, 0.0],
                                   "layer_types": _SLIDING_FULL_4, "final_logit_softcapping": 30.0,
                                   "output_multiplier": 1.0, "moe_hidden_size": 64}},
    "bailing_moe_v3": {"num_hidden_layers": 4, "n_group": 2, "topk_group": 1, "layer_group_size": 2},
    "kimi_k3": {"text_config": {"num_hidden_layers": 4, "num_experts": 4, "moe_intermediate_size": 64,
                                "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
                                "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                                       "num_heads": 4, "head_dim": 16,
                                                       "short_conv_kernel_size": 4}}},
    "bailing_moe": {"num_shared_experts": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "bailing_moe_linear": {"num_shared_experts": 1, "norm_topk_prob": True, "first_k_dense_replace": 1,
                           "num_hidden_layers": 4, "layer_group_size": 2, "group_norm_size": 1},
    "bailing_hybrid": {"num_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                       "num_hidden_layers": 4, "layer_group_size": 2, "group_norm_size": 1,
                       "routed_scaling_factor": 2.5},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0}},
    "deepseek_v2": {"rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                     "type": "yarn"}, **_MOE_SHARED},
    "dots1": {**_MOE_SHARED, "routed_scaling_factor": 2.5},
    "ernie4_5": {"use_bias": False},
    "ernie4_5_moe": {"use_bias": False},
    "glm4": {"attention_bias": True, "partial_rotary_factor": 0.5},
    "gpt_neox": {"rotary_emb_base": 10000, "rotary_pct": 0.25},
    "gptj": {"rotary_dim": 8},
    "granite": {**_GRANITE, "mlp_bias": False},
    "granitemoe": _GRANITE,
    "helium": {"attention_bias": False, "mlp_bias": False},
    "hunyuan": {"rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}, "attention_bias": False,
                "num_shared_expert": 1, "use_mixed_mlp_moe": True, "use_qk_norm": True, "use_cla": False,
                "cla_share_factor": 2},
    "jamba": {"num_hidden_layers": 4, "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2},
    "lfm2_moe": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
                 "norm_topk_prob": True, "use_expert_bias": True, "num_dense_layers": 1, "conv_bias": False,
                 "conv_L_cache": 3},
    "lille-130m": {"block_size": 4096},
    "llama4_text": {"num_hidden_layers": 4, "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0],
                    "use_qk_norm": True, "attention_chunk_size": CHUNK},
    "mamba": {"state_size": 16, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 4},
    "mamba2": {"num_heads": 8, "state_size": 16, "conv_kernel": 4, "n_groups": 1, "use_bias": False,
               "use_conv_bias": True, "time_step_limit": [0.0, 1e9], "time_step_rank": 4},
    "minicpm": {"dim_model_base": 256, "scale_depth": 1.4, "scale_emb": 12.0},
    "minicpm3": {"dim_model_base": 256, "scale_depth": 1.4, "scale_emb": 12.0,
                 "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 4, "short_factor": [1.0] * 4,
                                  "original_max_position_embeddings": 32768}},
    "minimax": {"rotary_dim": 8},
    "mistral4": {**_MOE_SHARED, "routed_scaling_factor": 1.0, "topk_group": 1, "n_group": 1,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                                     "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}},
    "nemotron": {"hidden_act": "relu2"},
    # Llama-3.1-Nemotron (NAS): per-block configs, one skipping its attention, one its FFN.
    "nemotron-nas": {"num_hidden_layers": 3, "block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.5}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"no_op": True}}]},
    "glm_moe_dsa": {**_MOE_SHARED, "index_head_dim": 32, "index_n_heads": 2, "index_topk": 4,
                    "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "n_group": 1, "topk_group": 1, "moe_layer_freq": 1, "attention_bias": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "spark2_5": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL_4,
                 "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                                     "full_attention": {"rope_theta": 1000000.0}}},
    "openelm": {"ffn_dim_divisor": 64, "num_query_heads": [4, 4], "num_kv_heads": [2, 2],
                "ffn_multipliers": [0.5, 4.0]},
    "phixtral": {"rotary_dim": 8},
    "plamo": {"n_shared_head": 2},
    "qwen": {"kv_channels": 16, "intermediate_size": 256},  # Qwen 1 halves intermediate_size per projection
    "step3p5": {"num_attention_groups": 2, "share_expert_dim": 64},
    "phi3small": {"dense_attention_every_n_layers": 2, "gegelu_limit": 20.0},
    "recurrent_gemma": {"attention_bias": False, "conv1d_width": 4, "logits_soft_cap": 30.0,
                        "num_hidden_layers": 3, "block_types": ["recurrent", "recurrent", "attention"]},
    "rwkv7": {"a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 16, "decay_low_rank_dim": 8},
    "solar_open": {**_MOE_SHARED, "routed_scaling_factor": 1.0, "partial_rotary_factor": 1.0},
    "stablelm": {"use_qkv_bias": False, "partial_rotary_factor": 0.25},
}

# Families of the installed mlx-lm that specd does not serve, and why.
NOT_SERVED: dict[str, str] = {
    "olmo": "mlx-lm's module imports the ai2-olmo package (OLMo 1), which neither mlx-lm nor specd installs; "
            "mlx_lm.server cannot load it either. OLMo 2, OLMo 3 and OLMo Hybrid are served.",
}
# Families that a Mac may serve but MLX's CPU backend cannot run, and why: untested off Metal.
METAL_ONLY = {
    "bitnet": "its forward runs a Metal kernel (mx.fast.metal_kernel) only",
    "muse_spark": "its forward runs Metal kernels only",
    "phi3small": "mlx_lm.generate alone aborts the process on MLX's CPU backend (glibc: corrupted size vs. "
                 "prev_size)",
}
# Families whose checkpoints carry something a tiny model cannot be forged with, and what.
UNFORGEABLE = {"prism_hadamard_qwen35": "its checkpoints carry a Hadamard rotation pack (schema 2) that mlx-lm "
                                        "reads from the weights; the forge cannot make one"}

# Modules of mlx_lm.models that hold no model family.
_NOT_FAMILIES = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline",
                 "rope_utils", "ssm", "switch_layers"}


def model_types() -> list[str]:
    """Every model family the installed mlx-lm ships (its ``mlx_lm.models`` modules)."""
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in _NOT_FAMILIES)


def served_families() -> list[str]:
    """The families specd serves: every one mlx-lm ships but ``NOT_SERVED``."""
    return [m for m in model_types() if m not in NOT_SERVED]


# Multimodal wrappers whose text model is another family's (the rest define TextArgs or TextConfig).
_TEXT_FAMILIES = {"gemma4": "gemma4_text", "lfm2-vl": "lfm2", "pixtral": "llama", "qwen2_vl": "qwen2",
                  "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe", "prism_hadamard_qwen35": "qwen3_5"}


def family_config(family: str) -> dict:
    """The config.json of ``family``'s tiny model: hand-written in ``FAMILIES``, else
    built from its ModelArgs (and, for a wrapper, its text model's under ``text_config``):
    ``TINY`` sizes for the fields it has, then ``SHAPES``."""
    if family in FAMILIES:
        return copy.deepcopy(FAMILIES[family])
    module = importlib.import_module(f"mlx_lm.models.{family}")
    config = {"model_type": family, **_COMMON, **_TOKENS, "tie_word_embeddings": False, **_tiny(module.ModelArgs)}
    shape = copy.deepcopy(SHAPES.get(family, {}))
    if "text_config" in {f.name for f in dataclasses.fields(module.ModelArgs)}:
        inner = _TEXT_FAMILIES.get(family)
        if inner is not None:
            text = {k: v for k, v in family_config(inner).items() if k != "architectures"}
        else:
            text_args = getattr(module, "TextArgs", None) or module.TextConfig
            text = {"model_type": f"{family}_text", **_COMMON, "tie_word_embeddings": False, **_tiny(text_args)}
        config["text_config"] = {**text, **shape.pop("text_config", {})}
    return {**config, **shape}


def _tiny(args: type) -> dict:
    """``TINY``'s sizes for the fields the ModelArgs class ``args`` has."""
    fields = {f.name for f in dataclasses.fields(args)}
    return {k: v for k, v in TINY.items() if k in fields}


def build(
    family: str,
    out_dir: Path | str,
    tokenizer_dir: Path | str,
    seed: int = 0,
    quantization: dict | None = None,
    overrides: dict | None = None,
) -> Path:
    """Write a tiny random ``family`` model to ``out_dir``; returns ``out_dir``.
    ``overrides`` replace fields of its (text) config: a benchmark's realistic widths.

    ``quantization`` is what mlx-community publishes, e.g. ``{"group_size":
    64, "bits": 4, "mode": "affine"}`` or for gpt_oss ``{"group_size": 32,
    "bits": 4, "mode": "mxfp4"}``; it is applied with ``mlx_lm``'s
    ``quantize_model`` (and the family's own quant predicate), which also
    writes the ``quantization`` entries into config.json.
    """
    config = family_config(family)
    _text(config).update(overrides or {})
    _check_vocab(config, Path(tokenizer_dir))
    model = make_model(config, seed)
    width = model(mx.array([[0]])).shape[-1]  # a shape: known without running the forward
    if width != _text(config)["vocab_size"]:
        raise ValueError(f"{family}: the model has {width} logits for a {_text(config)['vocab_size']}-token "
                         "tokenizer (its ModelArgs names its vocabulary size otherwise)")
    if quantization is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # its bits-per-weight line
            model, config = quantize_model(
                model,
                config,
                quantization["group_size"],
                quantization["bits"],
                mode=quantization.get("mode", "affine"),
            )
    out_dir = Path(out_dir)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, out_dir / name)
    return out_dir


def make_model(config: dict, seed: int = 0) -> nn.Module:
    """The float32 ``mlx_lm`` model of ``config``, with weights from ``seed``.

    The model is built the way ``mlx_lm.load`` builds it and its weights go
    through the family's ``sanitize``, so it has the loaded model's exact
    structure (a tied head, say) and saving it writes a post-sanitize
    checkpoint as mlx-community ones are. Reseeds mlx's global generator.
    """
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)  # the vectors (SSM A_log, biases) keep mlx-lm's own init
    model = model_class(args_class.from_dict(copy.deepcopy(config)))  # from_dict mutates
    tied = not any(name.endswith(_HEADS) for name, _ in tree_flatten(model.parameters()))
    weights = _init_weights(model, seed, tied)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    head = _FINAL_NORMS if tied else _HEADS
    _scale_logits(model, head, _text(config)["vocab_size"], seed)
    return model


# An untied head's weight, per family (InternLM 2 calls it ``output``).
_HEADS = ("lm_head.weight", "output.weight", "lm_head.linear.weight", "lm_head")
# The norm the last hidden state goes through before the head, per family.
_FINAL_NORMS = (
    "model.norm.weight",
    "model.embedding_norm.weight",
    "norm_f.weight",
    "final_layernorm.weight",
    "ln_f.weight",
    "output_norm.weight",
    "final_layer_norm.weight",
    "transformer.norm.weight",
)


def _init_weights(model: nn.Module, seed: int, tied: bool) -> dict[str, mx.array]:
    """Deterministic float32 weights for ``model``'s parameters.

    Matrices are N(0, 1/fan_in) and embeddings N(0, 1), so activations keep
    their scale through any family's blocks. A tied embedding doubles as the
    head, which makes the current token the best next one (its self dot
    product dominates) and greedy decoding repeat it forever. So the final
    norm's scale becomes zero-mean random, which removes that bias, and
    carries the logit scale instead of the embeddings, which stay small
    (std 0.1/sqrt(hidden)) so that the layers, not the current token,
    dominate the last hidden state even where the family scales embeddings
    up (Gemma by sqrt(hidden), Granite by 12). Other vectors (norm scales,
    biases, SSM A_log, D and dt_bias, attention sinks) keep the model's own
    initialisation.
    """
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for key, (name, p) in zip(keys, params):
        if tied and name.endswith(_FINAL_NORMS):
            std = 1.0
        elif p.ndim < 2:
            weights[name] = p
            continue
        elif name.endswith(("embed_tokens.weight", "embeddings.weight")):
            std = 0.1 / math.sqrt(p.shape[-1]) if tied else 1.0
        elif name.endswith(("conv.weight", "conv1d.weight")):  # depthwise (channels, kernel, 1)
            std = 1 / math.sqrt(math.prod(p.shape[1:]))
        else:  # (..., out, in), experts and heads stacked in front
            std = 1 / math.sqrt(p.shape[-1])
        weights[name] = std * mx.random.normal(p.shape, dtype=mx.float32, key=key)
    return weights


def _scale_logits(model: nn.Module, head: tuple[str, ...], vocab_size: int, seed: int) -> None:
    """Scale the parameters named ``head`` for logits of std ``LOGIT_STD``.

    Random models' near-uniform logits make greedy argmax ties that flip
    with float summation order (batch size, kernels); a std of a few units
    keeps the top-1/top-2 gap well above float noise. Measured on a random
    probe, so family quirks (Granite's logits_scaling, Gemma's 1 + weight
    norms, soft-capping) are accounted for.
    """
    names = [k for k, _ in tree_flatten(model.parameters()) if k.endswith(head)]
    if not names:
        raise ValueError(f"{type(model).__module__} has no parameter ending in {head}")
    probe = mx.random.randint(0, vocab_size, (1, 64), key=mx.random.key(seed))
    for _ in range(2):  # a second pass for the nearly-linear cases (1 + weight norms)
        factor = LOGIT_STD / mx.std(model(probe)).item()
        params = dict(tree_flatten(model.parameters()))
        model.update(tree_unflatten([(k, params[k] * factor) for k in names]))
        mx.eval(model.parameters())


def _text(config: dict) -> dict:
    """The part of ``config`` describing the language model."""
    return config.get("text_config", config)


def _check_vocab(config: dict, tokenizer_dir: Path) -> None:
    """Refuse a tokenizer whose ids the model's vocabulary would not cover."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok.get("added_tokens", [])}
    n = max(ids) + 1
    if n != _text(config)["vocab_size"]:
        raise ValueError(
            f"tokenizer in {tokenizer_dir} has {n} ids, the families' vocab_size "
            f"is {_text(config)['vocab_size']} (the forge test tokenizer's)"
        )
