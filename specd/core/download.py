"""Hub checkpoints, downloaded before a load with progress a user can see.

mlx-lm downloads a hub model inside ``load`` with nothing to show for it, and a
40 GB checkpoint looks like a hang. specd fetches the files first (``specd
pull``, or the reconciler before it reads a Model's memory request), into the
same Hugging Face cache with the same patterns, so the load that follows finds
every file there. An interrupted download keeps the files it completed (a
checkpoint's shards), and ``huggingface_hub`` resumes a file whose connection
dropped; progress is read from the cache's blobs as they grow, which holds for
every transfer the hub client uses.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from .memory import gib

MODEL_FILES = list(DEFAULT_ALLOW_PATTERNS)  # what mlx_lm.load reads: weights, configs, tokenizer, template
DRAFTER_FILES = [*MODEL_FILES, "*.safetensors"]  # an EAGLE head's weights need not be named model*.safetensors
POLL_SECONDS = 0.5


@dataclass
class DownloadProgress:
    """A download's bytes so far, across the checkpoints one load needs (a target and its drafter)."""

    total: int = 0  # bytes of every file the checkpoints need
    done: int = 0  # of which in the cache, partial files included
    present: int = 0  # in the cache before this download began
    started: float = field(default_factory=time.monotonic)
    listener: Callable[[DownloadProgress], None] | None = None  # told after each reading

    @property
    def active(self) -> bool:
        return self.done < self.total

    def rate(self) -> float:
        """Bytes per second this download has fetched (what was cached already not counted)."""
        return (self.done - self.present) / max(time.monotonic() - self.started, 1e-3)

    def eta_seconds(self) -> float | None:
        rate = self.rate()
        return (self.total - self.done) / rate if rate > 0 else None

    def as_dict(self) -> dict:
        eta = self.eta_seconds()
        return {"bytes": self.done, "totalBytes": self.total, "bytesPerSecond": round(self.rate()),
                "etaSeconds": None if eta is None else round(eta)}

    def message(self) -> str:
        percent = 100 * self.done / self.total if self.total else 0.0
        eta = self.eta_seconds()
        left = "" if eta is None else f", about {_duration(eta)} left"
        return (f"downloading: {gib(self.done)} of {gib(self.total)} ({percent:.0f}%), "
                f"{gib(round(self.rate()))}/s{left}")


def download(source: str, revision: str | None = None, progress: DownloadProgress | None = None,
             patterns: list[str] = MODEL_FILES) -> Path:
    """The hub checkpoint's snapshot directory, fetching the files the cache lacks (with
    ``progress``, read every ``POLL_SECONDS``). Raises what ``huggingface_hub`` raises when it is not cached and cannot
    be fetched (offline, the hub down, a gated or missing repo)."""
    from huggingface_hub import snapshot_download

    if progress is None:
        return Path(snapshot_download(source, revision=revision, allow_patterns=patterns))
    try:
        files = snapshot_download(source, revision=revision, allow_patterns=patterns, dry_run=True)
    except Exception:  # no listing (offline, the hub down): the cache may hold it; the real call says why if not
        return Path(snapshot_download(source, revision=revision, allow_patterns=patterns))
    cached = sum(f.file_size or 0 for f in files if not f.will_download)
    progress.total += sum(f.file_size or 0 for f in files)
    progress.done += cached
    progress.present += cached
    blobs = _blobs_dir(source)
    before = {p.name for p in _files(blobs)}  # a killed download's partial file is not resumed: not counted
    base = progress.done
    stop = threading.Event()

    def watch() -> None:
        while True:
            finished = stop.wait(POLL_SECONDS)
            # bytes of the blobs this download writes, partial files included
            progress.done = base + sum(_size(p) for p in _files(blobs) if p.name not in before)
            if progress.listener is not None:
                progress.listener(progress)
            if finished:
                return

    watcher = threading.Thread(target=watch, name="download-progress", daemon=True)
    watcher.start()
    commit = files[0].commit_hash if files else None
    try:  # at the commit the listing resolved: the hub is not asked again
        path = Path(snapshot_download(source, revision=commit or revision, allow_patterns=patterns))
    finally:
        stop.set()
        watcher.join()
    if commit is not None:
        _record_ref(source, revision, commit)
    return path


def _record_ref(source: str, revision: str | None, commit: str) -> None:
    """Record in the cache that ``revision`` (a branch or tag; None: the default branch) is at
    ``commit``, as the hub client records a download by name: a load offline then finds the
    snapshot by that name. A listing (``dry_run``) records nothing since huggingface_hub 2.5, and
    the download itself went by commit."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision

    try:
        _cache_commit_hash_for_specific_revision(str(_repo_dir(source)), revision or constants.DEFAULT_REVISION,
                                                 commit)
    except OSError:  # a cache this user cannot write: the snapshot is there, found by commit
        pass


def _repo_dir(source: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=source, repo_type="model")


def _blobs_dir(source: str) -> Path:
    return _repo_dir(source) / "blobs"


def _files(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.is_file()]
    except OSError:  # not created yet
        return []


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # a partial file renamed to its blob between listing and reading
        return 0


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 90 \
        else f"{seconds:.0f} s"
