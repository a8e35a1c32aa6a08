"""A forged embedding checkpoint, laid out as Qwen3-Embedding's are: a
Qwen3 decoder with the sentence-transformers files that say how its hidden
states are pooled; its weights as Qwen ships them (the decoder's keys without
the ``model.`` prefix, no LM head) or as an ``mlx_lm`` conversion has them."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ..core.embedding import POOLING_MODES, ST_NORMALIZE, ST_POOLING
from .families import build, family_config

ST_TRANSFORMER = "sentence_transformers.models.Transformer"
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def build_embedding(out_dir: Path | str, tokenizer_dir: Path | str, pooling: str = "lasttoken",
                    normalize: bool = True, seed: int = 0, as_shipped: bool = True) -> Path:
    """Write a tiny random Qwen3 embedding model to ``out_dir``; returns ``out_dir``.
    ``as_shipped``: its weights in Qwen's layout, else in ``mlx_lm``'s."""
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}")
    out_dir = build("qwen3", out_dir, tokenizer_dir, seed=seed)
    if as_shipped:
        weights_file = out_dir / "model.safetensors"
        weights = mx.load(str(weights_file))
        mx.save_safetensors(str(weights_file), {key.removeprefix("model."): value for key, value in weights.items()
                                                if not key.startswith("lm_head.")}, metadata={"format": "mlx"})
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST_TRANSFORMER},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_POOLING}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST_NORMALIZE})
        (out_dir / "2_Normalize").mkdir(exist_ok=True)
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{mode}": mode == pooling for mode in POOLING_MODES}
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": family_config("qwen3")["hidden_size"], **flags,
         "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
         "include_prompt": True}, indent=2))
    (out_dir / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}, indent=2))
    return out_dir
