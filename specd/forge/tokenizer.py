"""Byte-level BPE tokenizer trained on the Python standard library's sources.

No model hub is reachable, so the forge trains its own tokenizer. The stdlib
sources are on every machine that runs Python, which makes them a corpus that
needs no download. The tokenizer is written in the Hugging Face format that
``mlx_lm.load`` (via ``transformers.AutoTokenizer``) accepts.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)  # ids 0, 1, 2 in that order

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Directories whose .py files are tests, generated tables or vendored code:
# poor (or very repetitive) examples of Python.
_SKIP_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
)
_MAX_FILE_BYTES = 200_000


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[tuple[str, str]]:
    """Return ``(relative path, text)`` of the stdlib's .py files, sorted by path.

    Sorting makes every subset (and so everything trained on it) deterministic.
    """
    root = stdlib_root()
    paths = sorted(
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    out: list[tuple[str, str]] = []
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if not data.strip() or len(data) > _MAX_FILE_BYTES:
            continue
        try:
            out.append((p.relative_to(root).as_posix(), data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def spread(sources: list[tuple[str, str]], max_bytes: int) -> list[tuple[str, str]]:
    """Every n-th source, so that about ``max_bytes`` of text remain.

    Striding samples the whole library rather than its alphabetically first
    packages.
    """
    total = sum(len(text) for _, text in sources)
    return sources[:: max(1, -(-total // max_bytes))]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with the ChatML special tokens at ids 0..2.

    No prefix space is added and the ByteLevel decoder is used, so decoding
    round-trips any text (spaces and newlines included) exactly.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # A one-element Sequence decodes exactly like a bare ByteLevel decoder, but
    # keeps mlx_lm from choosing its BPEStreamingDetokenizer, which drops a
    # leading space from the first streamed token; mlx_lm falls back to its
    # naive detokenizer, whose output equals ``tokenizer.decode``.
    tok.decoder = decoders.Sequence([decoders.ByteLevel()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
    }
    for name, obj in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", special_map),
    ):
        (out_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
