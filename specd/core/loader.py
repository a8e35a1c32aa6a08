"""Loading weights and tokenizer: a local ``mlx_lm.load`` directory or a hub repo id."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load


def is_local_source(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or Path(source).exists()


def resolve_source(source: str) -> str:
    """A checked local directory, or the hub repo id as given."""
    if not is_local_source(source):
        return source
    path = Path(source).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: not an mlx-lm model directory")
    return str(path)


def load_model(source: str) -> tuple[nn.Module, object]:
    """Load a model with mlx-lm.  Local paths must exist; anything else is a
    Hugging Face repo id that mlx-lm downloads (what Mac users serve)."""
    model, tokenizer = mlx_lm_load(resolve_source(source))
    materialize(model)
    return model, tokenizer


def materialize(module: nn.Module) -> None:
    """Evaluate every array the module holds, parameters or not (llama3-scaled
    RoPE frequencies, say): an array left lazy belongs to the stream of the
    thread that built it, and the engine thread that runs the model cannot
    evaluate it."""
    mx.eval([value for _, value in tree_flatten(module) if isinstance(value, mx.array)])


def load_tokenizer(source: str):
    """Only the tokenizer (the daemon's side of a tensor-parallel model)."""
    from mlx_lm.utils import _download
    from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

    path = _download(resolve_source(source),
                     allow_patterns=["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"])
    config = json.loads((path / "config.json").read_text())
    return mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def load_draft_model(source: str, target: nn.Module, target_tokenizer, pairing: str) -> nn.Module:
    """A DraftPairing's draft model, refused unless its tokens mean the same as the target's."""
    draft, draft_tokenizer = load_model(source)
    check_draft_pair(target, target_tokenizer, draft, draft_tokenizer, pairing)
    return draft


def check_draft_pair(target: nn.Module, target_tokenizer, draft: nn.Module, draft_tokenizer, pairing: str) -> None:
    """Refuse a draft whose tokens do not mean the same as the target's."""
    tv, dv = target.args.vocab_size, draft.args.vocab_size
    if tv != dv:
        raise ValueError(f"DraftPairing {pairing}: draft vocabulary has {dv} tokens, the target's {tv}")
    if set(target_tokenizer.eos_token_ids) != set(draft_tokenizer.eos_token_ids):
        raise ValueError(f"DraftPairing {pairing}: draft EOS ids {sorted(draft_tokenizer.eos_token_ids)} "
                         f"differ from the target's {sorted(target_tokenizer.eos_token_ids)}")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"DraftPairing {pairing}: draft and target tokenizers differ")
