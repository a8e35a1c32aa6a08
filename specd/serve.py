"""``specd serve MODEL``: serve a model in one command, as ``ollama run`` and
``mlx_lm.server --model`` do, through the same control plane as a manifest.

The command line declares a Model (and, with ``--draft``, ``--eagle`` or
``--ngram``, its DraftPairing) owned by ``specd serve`` the way a watched file
owns what it declares: the next ``specd serve`` on the same state directory
replaces them, and objects added with ``specd apply`` stay. ``--dry-run -o
yaml`` prints the manifest it implies, for a user to grow into manifests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import yaml

from .api.manifest import NAME_RE, parse_documents
from .api.paths import API_VERSION

OWNER = "specd serve"  # the owner annotation of what ``specd serve`` declares
REPO_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")  # a Hugging Face repo id: owner/name


def default_state_dir() -> Path:
    """Where ``specd serve`` keeps its store unless told: the user's XDG state directory,
    so it neither clutters the working directory nor mixes with a manifest daemon's."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "specd"


def split_revision(model: str) -> tuple[str, str | None]:
    """``MODEL[@revision]``: a local path is taken whole; a hub id may name a branch, tag or commit."""
    if Path(model).expanduser().exists() or "@" not in model:
        return model, None
    source, revision = model.rsplit("@", 1)
    return source, revision or None


def checkpoint_source(model: str) -> str:
    """An existing local directory as an absolute path (what a manifest's source takes), else a hub repo id."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    if not REPO_ID_RE.fullmatch(model):
        raise ValueError(f"{model!r} is neither a local directory nor a Hugging Face repo id (owner/name)")
    return model


def model_name(source: str) -> str:
    """The served name clients ask for: the directory's or the repo's name as a DNS-1123 label
    (``mlx-community/Llama-3.2-3B-Instruct-4bit`` is ``llama-3-2-3b-instruct-4bit``)."""
    name = re.sub(r"[^a-z0-9-]+", "-", Path(source).name.lower()).strip("-")[:63].strip("-")
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"cannot make a model name of {source!r}; give one with --name")
    return name


def documents(args: argparse.Namespace) -> list[dict]:
    """The objects the command line declares, as manifest documents."""
    model, revision = split_revision(args.model)
    source = checkpoint_source(model)
    name = args.name or model_name(source)
    spec: dict = {"source": source}
    if revision is not None:
        spec["revision"] = revision
    for key, value in (("maxBatchSize", args.max_batch_size), ("maxContext", args.max_context)):
        if value is not None:
            spec[key] = value
    docs = [{"apiVersion": API_VERSION, "kind": "Model", "metadata": {"name": name}, "spec": spec}]
    method, drafter = (("draft", args.draft) if args.draft else ("eagle", args.eagle) if args.eagle
                       else ("ngram", None) if args.ngram else (None, None))
    if method is not None:
        pairing: dict = {"targetRef": name, "method": method, "numSpeculativeTokens": args.num_speculative_tokens}
        if drafter is not None:
            pairing["source"] = checkpoint_source(drafter)
        docs.append({"apiVersion": API_VERSION, "kind": "DraftPairing", "metadata": {"name": f"{name}-{method}"},
                     "spec": pairing})
    return docs


def manifest_text(docs: list[dict], output: str = "yaml") -> str:
    if output == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}, indent=2) + "\n"
    return yaml.safe_dump_all(docs, sort_keys=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``specd serve``'s own arguments (the daemon's are added beside them)."""
    parser.add_argument("model", metavar="MODEL[@REVISION]",
                        help="a local model directory, or a Hugging Face repo id (downloaded on first load)")
    parser.add_argument("--name", default=None, help="the model name clients ask for (default: from MODEL)")
    speculation = parser.add_mutually_exclusive_group()
    speculation.add_argument("--draft", metavar="MODEL", default=None,
                             help="speculate with this draft model (same tokenizer; a path or a repo id)")
    speculation.add_argument("--eagle", metavar="HEAD", default=None, help="speculate with this EAGLE head")
    speculation.add_argument("--ngram", action="store_true", help="speculate with prompt lookup (n-gram)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=3, metavar="K",
                        help="proposals per round (default 3)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="sequences decoding together")
    parser.add_argument("--max-context", type=int, default=None, help="tokens per request (default: the model's)")
    parser.add_argument("--dry-run", action="store_true", help="print the manifest this command implies, and exit")
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml", help="--dry-run's format")


def declared(args: argparse.Namespace) -> tuple[list[dict], str]:
    """The command line's objects and their manifest, checked as ``specd apply`` checks one
    (ValueError or ManifestError)."""
    docs = documents(args)
    text = manifest_text(docs)
    parse_documents(text, OWNER)
    return docs, text
