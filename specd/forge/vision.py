"""Tiny random-weight vision-language checkpoints, in the layouts mlx-vlm loads.

Each family is written as its Hugging Face checkpoint is (its ``config.json`` shape with tiny
sizes, HF parameter names, PyTorch convolution layouts, a ``preprocessor_config.json`` and a
chat template that renders image parts), so ``mlx_vlm.load`` reads it through its own
sanitizing, and ``mlx_lm.load`` reads its text half, as they read the checkpoints users serve.
The tokenizer is the forge's plus the family's image tokens. Needs ``mlx-vlm`` (specd[vision]).
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer

from .chat import HERMES, chat_variant
from .tokenizer import EOS, IM_END

VOCAB_MULTIPLE = 16  # the vocabulary: the tokenizer's ids and the family's image tokens, rounded up
# Gemma 3 scales its embeddings by sqrt(hidden) and ties its head to them: N(0, 1) embeddings
# would swamp the residual stream and every step would repeat one token whatever the image.
EMBED_STD = {"gemma3": 0.1}

# Qwen2-VL's template, trimmed: content is a string or a list of image and text parts.
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma 3's template, trimmed: an image part is <start_of_image>, which its processor expands.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<start_of_image>{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# LLaVA-1.5's conversation format.
LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}USER: {% elif m.role == 'system' %}{% else %}ASSISTANT: "
    "{% endif %}{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<image>\n{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class Family:
    """How one vision family's checkpoint is written."""

    config: Callable[[dict[str, int], int], dict]  # config.json from the image tokens' ids and the vocabulary
    special: tuple[str, ...]  # tokens the family adds to the forge tokenizer
    template: str
    preprocessor: dict
    processor: dict | None = None
    bos: str | None = None
    named_tokens: dict[str, str] = field(default_factory=dict)  # transformers' tokenizer.<name> attributes


def _qwen2_5_vl(ids: dict[str, int], vocab: int) -> dict:
    """Qwen/Qwen2.5-VL-3B-Instruct's config.json, shrunk."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
        "tie_word_embeddings": False, "vocab_size": vocab, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": [ids[EOS], ids[IM_END]],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": {
            "depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
            "num_heads": 2, "in_chans": 3, "out_hidden_size": 64, "patch_size": 14,
            "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2,
            "window_size": 112, "fullatt_block_indexes": [1], "tokens_per_second": 2,
            "model_type": "qwen2_5_vl",
        },
    }


def _qwen3_vl(ids: dict[str, int], vocab: int) -> dict:
    """Qwen/Qwen3-VL-2B-Instruct's config.json (nested text and vision configs), shrunk."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "tie_word_embeddings": False, "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "eos_token_id": [ids[EOS], ids[IM_END]],
        "text_config": {
            "model_type": "qwen3_vl_text", "hidden_size": 64, "head_dim": 16, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "max_position_embeddings": 4096,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
            "vocab_size": vocab, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False,
        },
        "vision_config": {
            "model_type": "qwen3_vl", "deepstack_visual_indexes": [0], "depth": 2,
            "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "in_channels": 3,
            "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 16,
            "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
    }


def _gemma3(ids: dict[str, int], vocab: int) -> dict:
    """google/gemma-3-4b-it's config.json, shrunk."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"], "mm_tokens_per_image": 4,
        "eos_token_id": [ids[EOS], ids["<end_of_turn>"]], "pad_token_id": 0,
        "initializer_range": 0.02, "torch_dtype": "float32",
        "vocab_size": vocab,  # mlx-lm's gemma3 reads the vocabulary here (its default is 262208)
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-6,
            "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 16, "sliding_window_pattern": 2, "vocab_size": vocab,
            "max_position_embeddings": 4096, "mm_tokens_per_image": 4,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 14,
            "image_size": 56, "num_channels": 3, "layer_norm_eps": 1e-6, "vision_use_head": False,
        },
    }


def _llava(ids: dict[str, int], vocab: int, text: dict | None = None) -> dict:
    """llava-hf/llava-1.5-7b-hf's config.json, shrunk; ``text`` a Llama config to use instead."""
    return {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "image_token_index": ids["<image>"], "ignore_index": -100,
        "projector_hidden_act": "gelu", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "pad_token_id": 0,
        "eos_token_id": [ids[EOS], ids[IM_END]], "vocab_size": vocab, "torch_dtype": "float32",
        "text_config": text or {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "vocab_size": vocab, "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 2, "patch_size": 14, "image_size": 28,
            "projection_dim": 32, "num_channels": 3, "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu",
        },
    }


QWEN_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
FAMILIES: dict[str, Family] = {
    "qwen2_5_vl": Family(_qwen2_5_vl, QWEN_SPECIAL, QWEN_TEMPLATE, {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
        "max_pixels": 112 * 112, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}),
    "qwen3_vl": Family(_qwen3_vl, QWEN_SPECIAL, QWEN_TEMPLATE, {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True}),
    "gemma3": Family(_gemma3, ("<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                               "<end_of_image>", "<image_soft_token>"), GEMMA_TEMPLATE, {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_convert_rgb": None, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "do_pan_and_scan": None, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2,
        "rescale_factor": 1 / 255, "size": {"height": 56, "width": 56}},
        processor={"image_seq_length": 4, "processor_class": "Gemma3Processor"}, bos="<bos>",
        named_tokens={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                      "eoi_token": "<end_of_image>"}),
    "llava": Family(_llava, ("<image>",), LLAVA_TEMPLATE, {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "crop_size": {"height": 28, "width": 28}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD, "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": 28}},
        processor={"patch_size": 14, "vision_feature_select_strategy": "default",
                   "num_additional_image_tokens": 1, "processor_class": "LlavaProcessor"}),
}


def write_tokenizer(tokenizer_dir: Path, out: Path, family: Family) -> dict[str, int]:
    """The forge tokenizer in ``tokenizer_dir`` with the family's tokens added as special ones,
    written to ``out``; returns the ids of the tokens a config names."""
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    for token in family.special:
        config["added_tokens_decoder"][str(tok.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
    config.update(chat_template=family.template, bos_token=family.bos, eos_token=EOS, pad_token=EOS,
                  add_bos_token=family.bos is not None)
    config["additional_special_tokens"] = [*config.get("additional_special_tokens", []), *family.special]
    if family.named_tokens:
        config["extra_special_tokens"] = family.named_tokens
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": EOS, **({"bos_token": family.bos} if family.bos else {}),
         "additional_special_tokens": config["additional_special_tokens"]}, indent=2))
    return {t: tok.token_to_id(t) for t in (*family.special, EOS, IM_END)}


def vocab_size(tokenizer_dir: Path) -> int:
    """What a checkpoint built on the tokenizer in ``tokenizer_dir`` names its vocabulary."""
    n = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _hf_name(family: str, name: str, value: mx.array) -> tuple[str, mx.array]:
    """An mlx-vlm parameter's name and layout in the family's Hugging Face checkpoint."""
    if family in ("qwen2_5_vl", "qwen3_vl"):
        nested = family == "qwen3_vl"  # transformers >= 4.57 nests both towers under model.
        if name.startswith("vision_tower."):
            name = ("model.visual." if nested else "visual.") + name[len("vision_tower."):]
            if name.endswith("patch_embed.proj.weight"):  # MLX (O, T, H, W, I) -> PyTorch (O, I, T, H, W)
                value = value.transpose(0, 4, 1, 2, 3)
        elif name.startswith("language_model.model."):
            name = ("model.language_model." if nested else "model.") + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            name = "lm_head." + name[len("language_model.lm_head."):]
        return name, value
    # Gemma 3 and LLaVA: mlx-vlm's names are the checkpoint's; only the convolution layout differs
    if name.endswith("patch_embedding.weight") and value.ndim == 4:  # (O, H, W, I) -> (O, I, H, W)
        value = value.transpose(0, 3, 1, 2)
    return name, value


def _instantiate(config: dict):
    """mlx-vlm's model of ``config``, built as its loader builds it."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(config)
    module, _ = get_model_and_args(config=config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    return module.Model(model_config)


def build(family: str, out_dir: Path | str, tokenizer_dir: Path | str, seed: int = 0,
          language_model: Path | str | None = None, text_overrides: dict | None = None) -> Path:
    """Write a tiny random ``family`` vision-language checkpoint to ``out_dir``; returns it.

    ``language_model`` (LLaVA only): an mlx-lm Llama checkpoint whose weights and config become the
    text half (the demo's vision model is the forge's trained target with a random vision tower).
    ``text_overrides``: fields of the text config to replace (a benchmark's wider model)."""
    spec = FAMILIES[family]
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    ids = write_tokenizer(Path(tokenizer_dir), out, spec)
    vocab = vocab_size(out)
    text = None
    if language_model is not None:
        if family != "llava":
            raise ValueError("only a LLaVA checkpoint takes a trained language model")
        text = json.loads((Path(language_model) / "config.json").read_text())
        text.update(vocab_size=vocab, architectures=["LlamaForCausalLM"])
        text.pop("quantization", None)
    config = _llava(ids, vocab, text) if text is not None else spec.config(ids, vocab)
    text_config = config.get("text_config") or config
    text_config.update(text_overrides or {})
    if "out_hidden_size" in config["vision_config"]:  # Qwen-VL's merger projects into the text width
        config["vision_config"]["out_hidden_size"] = text_config["hidden_size"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(spec.preprocessor, indent=2))
    if spec.processor is not None:
        (out / "processor_config.json").write_text(json.dumps(spec.processor, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": spec.template}))

    mx.random.seed(seed)
    params = dict(tree_flatten(_instantiate(config).parameters()))
    for i, (name, value) in enumerate(sorted(params.items())):
        if value.ndim < 2:  # norms and biases keep their init
            continue
        fan_in = value[0].size if "patch_embed" in name else value.shape[-1]
        std = EMBED_STD.get(family, 1.0) if "embed_tokens" in name else fan_in ** -0.5
        params[name] = mx.random.normal(value.shape, key=mx.random.key(seed * 100003 + i)) * std
    if text is not None:
        params.update(_padded_text_weights(Path(language_model), vocab))
    weights = dict(_hf_name(family, name, value.astype(mx.float32)) for name, value in params.items())
    if family == "gemma3":  # Gemma 3 ties its head to the embeddings: the checkpoint has none
        weights.pop("language_model.lm_head.weight", None)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def _padded_text_weights(path: Path, vocab: int) -> dict[str, mx.array]:
    """An mlx-lm Llama checkpoint's weights under LLaVA's ``language_model.`` names, the
    embedding and head widened to ``vocab`` rows (the image token's rows are zero)."""
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(file)).items():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")) and value.shape[0] < vocab:
                value = mx.concatenate([value, mx.zeros((vocab - value.shape[0], value.shape[1]), value.dtype)])
            weights[f"language_model.{name}"] = value
    return weights


# Hermes tool conventions over a LLaVA checkpoint: a message's content may hold image parts.
HERMES_IMAGES = (
    "{% macro content(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}{% if p.type == 'image' %}"
    "<image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    + HERMES.replace("{{ m.content }}", "{{ content(m.content) }}").replace("{{ m.content or '' }}",
                                                                        "{{ content(m.content or '') }}")
)


def agent_variant(source: Path | str, out_dir: Path | str, context: int) -> Path:
    """A LLaVA checkpoint in Hermes tool conventions whose messages may hold images, its window
    ``context`` wide: what an agent client that sends screenshots and image files talks to."""
    out = chat_variant(source, out_dir, "hermes", context=context)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = HERMES_IMAGES
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False, indent=1))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": HERMES_IMAGES}))
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
