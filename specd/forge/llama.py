"""Llama model shapes, deterministic initialisation and mlx_lm-loadable saving.

The models are mlx_lm's own ``llama`` implementation, so what the forge
writes loads with ``mlx_lm.load`` exactly like a converted checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.llama import Model, ModelArgs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class LlamaShape:
    """The architecture knobs the forge varies; the rest are Llama defaults."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


def hf_config(shape: LlamaShape, eos_token_ids: list[int], pad_token_id: int) -> dict:
    """A Hugging Face style config.json for ``shape`` (float32, no BOS)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": list(eos_token_ids),
        "pad_token_id": pad_token_id,
        "torch_dtype": "float32",
    }


def build(shape: LlamaShape) -> Model:
    """An mlx_lm llama ``Model`` with mlx's default (unusable) initialisation."""
    return Model(ModelArgs.from_dict({"model_type": "llama", **asdict(shape)}))


def init_weights(
    model: Model,
    seed: int,
    embed_std: float = 0.02,
    std: float = 0.02,
    head_std: float | None = None,
) -> None:
    """Re-initialise ``model`` GPT-2 style, deterministically from ``seed``.

    mlx's default normal(0, 1) embeddings blow up tied logits, so embeddings
    use ``embed_std``; projections writing into the residual stream are scaled
    down by sqrt(2 * layers) so the stream's variance stays bounded with depth.
    """
    n_layers = len(model.layers)
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for key, (name, p) in zip(keys, params):
        if name.endswith("norm.weight"):
            w = mx.ones(p.shape, dtype=mx.float32)
        else:
            if "embed_tokens" in name:
                s = embed_std
            elif name.startswith("lm_head"):
                s = std if head_std is None else head_std
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                s = std / math.sqrt(2 * n_layers)
            else:
                s = std
            w = s * mx.random.normal(p.shape, dtype=mx.float32, key=key)
        new.append((name, w))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def num_params(model: Model) -> int:
    """Number of stored parameters (a tied head counts once)."""
    return sum(p.size for _, p in tree_flatten(model.parameters()))


def save(model: Model, config: dict, tokenizer_dir: Path, out_dir: Path) -> None:
    """Write an ``mlx_lm.load``-able directory: config, float32 weights, tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]))
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
