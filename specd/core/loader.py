"""Loading weights and tokenizer: a local ``mlx_lm.load`` directory or a hub repo id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load

from . import cpu_jit, dispatch
from .embedding import Pooling, read_pooling


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


def load_model(source: str, revision: str | None = None) -> tuple[nn.Module, object]:
    """Load a model with mlx-lm.  Local paths must exist; anything else is a
    Hugging Face repo id that mlx-lm downloads (what Mac users serve), at
    ``revision`` (a branch, tag or commit) when given. On a CPU, MLX's kernels are built for
    its FMA first (``cpu_jit``), and an engine's forwards start each decoder layer as it is built
    (``dispatch``)."""
    cpu_jit.install()
    model, tokenizer = mlx_lm_load(resolve_source(source), revision=revision)
    materialize(model)
    dispatch.install(model)
    return model, tokenizer


CONVERT_BIN = (
    "MLX cannot read PyTorch pickles (pytorch_model*.bin); convert them once, in the checkpoint "
    "directory (a hub repo: `huggingface-cli download REPO --local-dir DIR` first, then load DIR):\n"
    "  python -c \"import glob, torch; from safetensors.torch import save_file; "
    "sd = {k: v.clone().contiguous() for f in sorted(glob.glob('pytorch_model*.bin')) "
    "for k, v in torch.load(f, map_location='cpu').items()}; "
    "save_file(sd, 'model.safetensors', metadata={'format': 'pt'})\""
)


def checkpoint_directory(source: str, revision: str | None = None) -> Path:
    """A checkpoint's local directory: the directory given, or the hub snapshot of its config and
    safetensors at ``revision`` (downloaded where they are not cached yet)."""
    from mlx_lm.utils import _download

    return Path(_download(resolve_source(source), revision=revision,
                          allow_patterns=["*.json", "*.safetensors"]))


def read_tensors(path: Path, wanted: Callable[[str], bool] = lambda name: True) -> dict[str, mx.array]:
    """The ``wanted`` tensors of a checkpoint directory's safetensors files, by name (loaded lazily
    by MLX; with an index, only the files that hold wanted ones are opened)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for name, f in json.loads(index.read_text())["weight_map"].items() if wanted(name)})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files and not index.exists():
        found = sorted(p.name for p in path.glob("*.bin"))
        raise FileNotFoundError(f"{path} has no *.safetensors weights"
                                + (f" (it has {', '.join(found)})" if found else "") + ". " + CONVERT_BIN)
    tensors: dict[str, mx.array] = {}
    for file in files:
        for name, array in mx.load(str(file)).items():
            if not wanted(name):
                continue
            if name in tensors:
                raise ValueError(f"tensor {name} appears twice in {path}")
            tensors[name] = array
    return tensors


def text_config(model: nn.Module) -> dict:
    """The language model's configuration: the model's args (``with_text_config``)."""
    args = getattr(model, "args", None)
    return with_text_config(dict(vars(args)) if args is not None and not isinstance(args, dict) else dict(args or {}))


def with_text_config(values: dict) -> dict:
    """A configuration (a model's args, a checkpoint's ``config.json``) with its nested
    ``text_config`` (multimodal checkpoints: Mistral 3, Qwen 3.5, Llama 4, Gemma 3)
    taking precedence."""
    nested = values.get("text_config")
    if isinstance(nested, dict):
        return {**values, **nested}
    return {**values, **vars(nested)} if hasattr(nested, "__dict__") else values


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (quantized weights as stored)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def vocab_size(model: nn.Module) -> int:
    """The number of logits the model produces (its configuration's, else
    the shape of an unevaluated forward: shapes are known without running it)."""
    size = text_config(model).get("vocab_size")
    return int(size) if size else int(model(mx.array([[0]])).shape[-1])


POSITION_KEYS = ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions", "max_sequence_length")
UNDECLARED_CONTEXT = 131072  # a model that declares no limit (recurrent ones): a bound on what one request may hold
STRETCHING_ROPE = ("yarn", "dynamic", "linear")  # the scaled window is original x factor


def context_window(model: nn.Module, tokenizer) -> int:
    """The context the model was built for: its declared maximum position,
    widened by RoPE scaling that stretches an original window, else the
    tokenizer's ``model_max_length``, else ``UNDECLARED_CONTEXT``."""
    declared = declared_window(text_config(model))
    if declared:
        return declared
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 10**7 else UNDECLARED_CONTEXT


def declared_window(config: dict) -> int | None:
    """The maximum position a configuration declares, widened by RoPE scaling that stretches an original window."""
    declared = next((int(config[k]) for k in POSITION_KEYS if config.get(k)), None)
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}  # transformers 5 renamed it
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in STRETCHING_ROPE and scaling.get("factor") and scaling.get("original_max_position_embeddings"):
        declared = max(declared or 0, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return declared


def materialize(module: nn.Module) -> None:
    """Evaluate every array the module holds, parameters or not (llama3-scaled
    RoPE frequencies, say): an array left lazy belongs to the stream of the
    thread that built it, and the engine thread that runs the model cannot
    evaluate it.

    And MLX's global key: building the module drew its initial weights from
    it, each draw splitting the key, and the checkpoint's weights replaced the
    draws unevaluated. The key kept every split's graph (about 2 KB a weight)
    until a draw from it was evaluated, which a serving daemon seldom does
    (every request has a key of its own; only timing a new attention shape's
    layouts draws from it), so each load of a Model left its draws in memory."""
    mx.eval([value for _, value in tree_flatten(module) if isinstance(value, mx.array)], mx.random.state)


def load_tokenizer(source: str, revision: str | None = None):
    """Only the tokenizer (the daemon's side of a tensor-parallel model)."""
    from mlx_lm.utils import _download
    from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

    path = _download(resolve_source(source), revision,
                     allow_patterns=["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"])
    config = json.loads((path / "config.json").read_text())
    return mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def load_embedding_model(source: str, revision: str | None = None) -> tuple[nn.Module, object, Pooling]:
    """An embedding checkpoint: the model (without an LM head if it ships none), its
    tokenizer and its pooling (read from the sentence-transformers files beside the weights)."""
    from mlx_lm.utils import _download, load_model as mlx_lm_model
    from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

    path = _download(resolve_source(source), revision)
    model, config = mlx_lm_model(path, get_model_classes=_embedding_classes)
    materialize(model)
    tokenizer = mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, read_pooling(path)


def _embedding_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's classes for the checkpoint's family, reading the layout embedding checkpoints
    ship in: Qwen's Qwen3-Embedding stores the decoder's weights without its ``model.`` prefix,
    and its 8B has no LM head although its config is untied (an embedder never reads the head,
    so a checkpoint without one loads without one)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)

    class EmbeddingCheckpoint(model_class):
        def sanitize(self, weights: dict) -> dict:
            if not any(key.startswith("model.") for key in weights):
                weights = {key if key.startswith("lm_head.") else f"model.{key}": value
                           for key, value in weights.items()}
            if hasattr(model_class, "sanitize"):
                weights = model_class.sanitize(self, weights)
            if "lm_head" in self and not any(key.startswith("lm_head.") for key in weights):
                del self["lm_head"]
            return weights

    return EmbeddingCheckpoint, args_class


def load_draft_model(source: str, target: nn.Module, target_tokenizer, pairing: str) -> nn.Module:
    """A DraftPairing's draft model, refused unless its tokens mean the same as the target's."""
    draft, draft_tokenizer = load_model(source)
    check_draft_pair(target, target_tokenizer, draft, draft_tokenizer, pairing)
    return draft


def check_draft_pair(target: nn.Module, target_tokenizer, draft: nn.Module, draft_tokenizer, pairing: str) -> None:
    """Refuse a draft whose tokens do not mean the same as the target's."""
    tv, dv = vocab_size(target), vocab_size(draft)
    if tv != dv:
        raise ValueError(f"DraftPairing {pairing}: draft vocabulary has {dv} tokens, the target's {tv}")
    if set(target_tokenizer.eos_token_ids) != set(draft_tokenizer.eos_token_ids):
        raise ValueError(f"DraftPairing {pairing}: draft EOS ids {sorted(draft_tokenizer.eos_token_ids)} "
                         f"differ from the target's {sorted(target_tokenizer.eos_token_ids)}")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"DraftPairing {pairing}: draft and target tokenizers differ")
