"""Loading weights and tokenizer: a local ``mlx_lm.load`` directory or a hub repo id."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
from mlx_lm import load as mlx_lm_load


def is_local_source(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or Path(source).exists()


def load_model(source: str) -> tuple[nn.Module, object]:
    """Load a model with mlx-lm.  Local paths must exist; anything else is a
    Hugging Face repo id that mlx-lm downloads (what Mac users serve)."""
    if is_local_source(source):
        path = Path(source).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not an mlx-lm model directory")
        source = str(path)
    model, tokenizer = mlx_lm_load(source)
    return model, tokenizer
