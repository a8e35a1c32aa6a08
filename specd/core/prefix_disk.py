"""The prefix cache's disk tier: cached prefixes in files that outlive the engine.

The RAM tree (``prefix.py``) is gone when its engine stops: a Model evicted, scaled to zero,
restarted by a rollout, or a daemon restarted. An agent's next request then prefills tens of
thousands of tokens again. ``DiskTier`` keeps what the tree records in blocks of
``BLOCK_TOKENS`` positions, each a file named by the chained hash of every token up to its end
(vLLM's block hashes) under a namespace of everything else that decides what the block holds:
the checkpoint's files, the KV quantization, the file format. A Model with other weights, other
KV bits or an older format never finds another's blocks.

- **Writing** never waits on the request's path: the engine thread hands a block's arrays (views
  of the tree's nodes, which the block's references keep alive) to a writer thread, which copies,
  checksums and writes it to a temporary file renamed into place. Blocks that a full queue cannot
  take are dropped, as is every write while the disk refuses them (full, read-only): the engine
  serves on without the tier, and its status and ``specd_prefix_disk_available`` say why.
- **Reading** happens on a thread of its own while other rows keep decoding: a request whose prompt
  starts with more blocks on disk than the RAM tree holds waits for them, and the engine thread
  puts what was read into the tree, where every later request finds it in RAM.
- **Recurrent layers** have no positions: a block also holds their state after its last token
  when the tree had a snapshot there (a prefill chunk ends on a block boundary for that reason), and
  a model with such layers resumes only at the end of a block with a snapshot.
- **Safe**: a file whose magic, format, length or checksum is wrong, or whose tokens are not the
  ones asked for, is never loaded: it is deleted and counted. The directory is kept within
  ``maxBytes`` by deleting the least recently used blocks (a hit touches its files, so the order
  survives a restart).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
import structlog

from .cache import Snapshot
from .columns import Columns, Pieces, Side, pair_concat, pair_slice, parts

log = structlog.get_logger(__name__)

BLOCK_TOKENS = 256  # positions a block holds: one file per block, so a hit reads few files
FORMAT = 1  # the file layout's version: a block of another version is refused, never loaded
MAGIC = b"SPECDKV\x00"
SUFFIX, SNAPSHOT_SUFFIX = ".blk", ".sblk"  # a block, and one holding the recurrent state at its end
_PREFIX = struct.Struct("<8sII")  # magic, format, header length
DIGEST_BYTES = 32  # sha256 of everything before it
PENDING_BYTES = 512 * 2**20  # blocks waiting for the writer at most; more are dropped, never waited for
RETRY_SECONDS = 60.0  # after a write fails (disk full, read-only), how long until the next try
STORED_AS = {"bfloat16": np.uint16}  # dtypes numpy lacks, stored as their bits


@dataclass(frozen=True)
class DiskConfig:
    """Where a Model's blocks live and how many bytes they may take; ``identity`` names the
    checkpoint (``checkpoint_identity``)."""

    directory: Path
    max_bytes: int
    identity: str


def checkpoint_identity(directory: Path) -> str:
    """What names a checkpoint's weights without reading them: each weight and config file's
    resolved path, size and modification time. A hub snapshot's files resolve to blobs named by
    their content, a local checkpoint written again gets new times: either way other weights
    get another identity, and no block of the old ones is read."""
    files = sorted(p for p in Path(directory).iterdir() if p.suffix in (".safetensors", ".json", ".npz"))
    entries = []
    for path in files:
        real = path.resolve()
        stat = real.stat()
        entries.append([path.name, str(real), stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def namespace(identity: str, quantization: tuple[int, int] | None, cache: str) -> str:
    """Everything besides the tokens that decides what a block holds."""
    key = {"format": FORMAT, "checkpoint": identity, "kvQuantization": quantization, "cache": cache}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def chain(space: str, tokens: Sequence[int], blocks: int, size: int = BLOCK_TOKENS) -> list[str]:
    """The hashes of the first ``blocks`` blocks of ``tokens``, each over the one before it."""
    ids = np.asarray(tokens[: blocks * size], dtype="<i8")
    out, previous = [], bytes.fromhex(space)
    for j in range(blocks):
        previous = hashlib.sha256(previous + ids[j * size:(j + 1) * size].tobytes()).digest()
        out.append(previous.hex())
    return out


def _stored(array: mx.array) -> mx.array:
    """An array as the writer thread can read it (numpy has no bfloat16: its bits)."""
    return array.view(mx.uint16) if array.dtype == mx.bfloat16 else array


def _dtype(array: mx.array) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


@dataclass
class Part:
    """One array of a side (a plain side has one, a quantized side three) over a block's pieces,
    evaluated on the engine thread and read by the writer's."""

    dtype: str
    pieces: list[mx.array]

    @staticmethod
    def of(arrays: list[mx.array]) -> "Part":
        return Part(_dtype(arrays[0]), [_stored(a) for a in arrays])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.pieces)


@dataclass
class Block:
    """A block to write: per attention layer its keys' and values' parts, and the recurrent
    state after its last token (one part per array, None where a state has none)."""

    hash: str
    tokens: np.ndarray
    columns: list[tuple[list[Part], list[Part]]]
    snapshot: list[list[Part | None]] | None = None

    @staticmethod
    def of(hash_: str, tokens: np.ndarray, pieces: list[Pieces], snapshot: Snapshot | None) -> "Block":
        """A block from a layer's consecutive pieces (views of the tree's nodes)."""
        columns = [tuple([Part.of([parts(piece[s])[i] for piece in layer]) for i in range(len(parts(layer[0][s])))]
                         for s in (0, 1)) for layer in pieces]
        state = None if snapshot is None else [[None if a is None else Part.of([a]) for a in arrays]
                                               for arrays in snapshot]
        return Block(hash_, tokens, columns, state)

    def arrays(self) -> list[mx.array]:
        """What the engine thread evaluates before handing the block over."""
        out = [a for layer in self.columns for side in layer for part in side for a in part.pieces]
        return out + [a for state in self.snapshot or [] for part in state if part is not None for a in part.pieces]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


@dataclass
class ReadBlock:
    """A block read back: per attention layer its keys and values, and the recurrent state."""

    columns: Columns
    snapshot: Snapshot | None


class BlockError(Exception):
    """A block file that must not be loaded; ``kind``: corrupt, truncated, foreign or mismatched."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _host(part: Part) -> tuple[dict, np.ndarray]:
    """A part's pieces as one host array (the writer thread's copy) and its layout."""
    host = np.ascontiguousarray(np.concatenate([np.asarray(a) for a in part.pieces], axis=-2)
                                if len(part.pieces) > 1 else np.asarray(part.pieces[0]))
    return {"dtype": part.dtype, "shape": list(host.shape)}, host


def encode(space: str, block: Block) -> list:
    """The file's parts, in order (the writer thread's work: the arrays are copied here)."""
    arrays: list[np.ndarray] = []

    def layout(part: Part | None) -> dict | None:
        if part is None:
            return None
        entry, host = _host(part)
        arrays.append(host)
        return entry

    columns = [[[layout(part) for part in side] for side in layer] for layer in block.columns]
    snapshot = None if block.snapshot is None else [[layout(part) for part in state] for state in block.snapshot]
    header = json.dumps({"namespace": space, "hash": block.hash, "tokens": block.tokens.tolist(),
                         "columns": columns, "snapshot": snapshot}).encode()
    return [_PREFIX.pack(MAGIC, FORMAT, len(header)), header, *arrays]


def decode(data: bytes, space: str, hash_: str, tokens: np.ndarray) -> ReadBlock:
    """A block read back, checked whole before any of it is used."""
    if len(data) < _PREFIX.size + DIGEST_BYTES:
        raise BlockError("truncated", f"{len(data)} bytes")
    magic, version, header_length = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != FORMAT:
        raise BlockError("foreign", f"format {version!r} (magic {magic!r}); this specd reads format {FORMAT}")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + header_length])
        entries = [e for layer in header["columns"] for side in layer for e in side]
        entries += [e for state in header["snapshot"] or [] for e in state if e is not None]
        payload = sum(STORED_AS.get(e["dtype"], np.dtype(e["dtype"])).itemsize * int(np.prod(e["shape"]))
                      for e in entries)
    except (ValueError, KeyError, TypeError) as exc:
        kind = "truncated" if len(data) < _PREFIX.size + header_length else "corrupt"
        raise BlockError(kind, f"unreadable header: {exc}") from None
    expected = _PREFIX.size + header_length + payload + DIGEST_BYTES
    if len(data) != expected:
        raise BlockError("truncated" if len(data) < expected else "corrupt", f"{len(data)} bytes of {expected}")
    if hashlib.sha256(memoryview(data)[:-DIGEST_BYTES]).digest() != data[-DIGEST_BYTES:]:
        raise BlockError("corrupt", "checksum does not match")
    if header["namespace"] != space or header["hash"] != hash_ or header["tokens"] != tokens.tolist():
        raise BlockError("mismatched", "the block holds other tokens or another model's state")
    offset = _PREFIX.size + header_length

    def take(entry: dict | None) -> mx.array | None:
        nonlocal offset
        if entry is None:
            return None
        dtype = STORED_AS.get(entry["dtype"], np.dtype(entry["dtype"]))
        count = int(np.prod(entry["shape"]))
        host = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(entry["shape"])
        offset += host.nbytes
        array = mx.array(host)
        return array.view(getattr(mx, entry["dtype"])) if entry["dtype"] in STORED_AS else array

    def side(entries: list[dict]) -> Side:
        arrays = [take(e) for e in entries]
        return tuple(arrays) if len(arrays) > 1 else arrays[0]

    columns = [(side(keys), side(values)) for keys, values in header["columns"]]
    snapshot = None if header["snapshot"] is None else [[take(e) for e in state] for state in header["snapshot"]]
    return ReadBlock(columns, snapshot)


@dataclass
class _Entry:
    path: Path
    size: int
    snapshot: bool


@dataclass
class DiskCounters:
    hit_tokens: int = 0  # tokens put into the RAM tree from disk
    read_bytes: int = 0
    written_bytes: int = 0
    written_blocks: int = 0
    dropped_blocks: int = 0  # not written: the queue was full or the disk refused writes
    evicted_blocks: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by kind: corrupt, truncated, foreign, mismatched


class _Directory:
    """A directory's block files as every tier of this process on it counts them (an engine
    reloaded beside the one it replaces writes to the same directory while the old one drains):
    their bytes, least recently used first, so that together they stay within ``maxBytes``."""

    _open: dict[Path, "_Directory"] = {}
    _open_lock = threading.Lock()

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.files: dict[Path, int] = {}
        self.bytes = 0
        self.scanned = False
        self.users = 0

    @classmethod
    def open(cls, path: Path) -> "_Directory":
        with cls._open_lock:
            directory = cls._open.setdefault(path.resolve(), cls(path.resolve()))
            directory.users += 1
            return directory

    def release(self) -> None:
        with self._open_lock:
            self.users -= 1
            if self.users == 0:
                del self._open[self.path]


class DiskTier:
    """One Model's blocks on disk: which are there, writing new ones, reading them back.

    ``on_change(tier)`` is called (from any of its threads) when the counters or the tier's
    health change, for metrics."""

    def __init__(self, config: DiskConfig, space: str, stateful: bool,
                 on_change: Callable[["DiskTier"], None] = lambda tier: None,
                 block_tokens: int = BLOCK_TOKENS):
        self.config = config
        self.space = space
        self.stateful = stateful
        self.block = block_tokens
        self.counters = DiskCounters()
        self.error: str | None = None  # why the tier writes nothing now
        self._retry_at = 0.0
        self._on_change = on_change
        self._directory = _Directory.open(config.directory)
        self._lock = self._directory.lock  # the index too: one lock for what a tier changes at once
        self._index: dict[str, _Entry] = {}  # this namespace's blocks
        self._pending = 0
        self._queued: set[str] = set()  # hashes waiting for the writer
        self._queue: queue.Queue[Block | None] = queue.Queue()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="specd-prefix-read")
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="specd-prefix-write", daemon=True)
        self._writer.start()

    @property
    def directory(self) -> Path:
        return self.config.directory / self.space[:32]

    @property
    def bytes(self) -> int:
        """What the directory's block files hold (every namespace's)."""
        return self._directory.bytes

    # -- the index --------------------------------------------------------------

    def _scan(self) -> None:
        """What the directory holds, oldest use first; leftover temporary files go. Where another
        tier of this process has the directory open (the engine this one replaces), what it
        counts is taken as it is (its writer's temporary files are no leftovers)."""
        with self._lock:
            if self._directory.scanned:
                for path, size in self._directory.files.items():
                    if path.parent.parent == self.directory:
                        self._note(path, size)
                return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            found = []
            for path in self.config.directory.rglob("*"):
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                elif path.suffix in (SUFFIX, SNAPSHOT_SUFFIX):
                    stat = path.stat()
                    found.append((stat.st_mtime_ns, path, stat.st_size))
        except OSError as exc:
            self._fail(exc)
            return
        with self._lock:
            for _, path, size in sorted(found):
                self._directory.files[path] = size
                self._directory.bytes += size
                if path.parent.parent == self.directory:
                    self._note(path, size)
            self._directory.scanned = True

    def _note(self, path: Path, size: int) -> None:
        hash_, snapshot = path.name.split(".")[0], path.suffix == SNAPSHOT_SUFFIX
        known = self._index.get(hash_)
        if known is None or (snapshot and not known.snapshot):
            self._index[hash_] = _Entry(path, size, snapshot)

    def _path(self, hash_: str, snapshot: bool) -> Path:
        return self.directory / hash_[:2] / (hash_ + (SNAPSHOT_SUFFIX if snapshot else SUFFIX))

    def held(self, tokens: Sequence[int], limit: int) -> int:
        """How many leading tokens of ``tokens[:limit]`` the disk holds, in whole blocks (a model
        with recurrent layers: up to the last block that holds their state)."""
        hashes = chain(self.space, tokens, limit // self.block, self.block)
        best = 0
        for j, hash_ in enumerate(hashes):
            with self._lock:
                entry = self._index.get(hash_) or self._discover(hash_)
            if entry is None:
                break
            if not self.stateful or entry.snapshot:
                best = (j + 1) * self.block
        return best

    def _discover(self, hash_: str) -> _Entry | None:
        """A block another engine on this directory wrote after this one looked (a reload beside
        the old engine, which writes on as it drains)."""
        for snapshot in (True, False):
            path = self._path(hash_, snapshot)
            try:
                size = path.stat().st_size
            except OSError:
                continue
            self._directory.files[path] = size
            self._directory.bytes += size
            self._note(path, size)
            return self._index[hash_]
        return None

    def missing(self, hashes: list[str], snapshot_at: int | None) -> list[int]:
        """Which of these blocks the disk lacks (block ``snapshot_at`` also lacks it without its state)."""
        with self._lock:
            return [j for j, h in enumerate(hashes) if h not in self._queued
                    and (h not in self._index or (j == snapshot_at and not self._index[h].snapshot))]

    # -- writing ----------------------------------------------------------------

    def save(self, block: Block) -> None:
        """Queue a block for the writer (the engine thread: never waits)."""
        size = block.nbytes
        if self.error is not None and time.monotonic() < self._retry_at:
            self._drop()
            return
        with self._lock:
            if self._pending + size > PENDING_BYTES:
                full = True
            else:
                full = False
                self._pending += size
                self._queued.add(block.hash)
        if full:
            self._drop()
            return
        self._queue.put(block)

    def _drop(self) -> None:
        self.counters.dropped_blocks += 1
        self._on_change(self)

    def _write_loop(self) -> None:
        while (block := self._queue.get()) is not None:
            try:
                self._write(block)
            except OSError as exc:
                self._fail(exc)
                self._drop()
            except Exception:  # a block that cannot be encoded is lost, never the writer
                log.exception("writing a prefix block failed", directory=str(self.config.directory))
                self._drop()
            finally:
                with self._lock:
                    self._pending -= block.nbytes
                    self._queued.discard(block.hash)
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, block: Block) -> None:
        path = self._path(block.hash, block.snapshot is not None)
        parts_ = encode(self.space, block)
        size = sum(memoryview(part).nbytes for part in parts_) + DIGEST_BYTES
        if size > self.config.max_bytes:
            self._drop()
            return
        self._evict(size)  # room first: the directory never holds more than maxBytes
        digest = hashlib.sha256()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as f:
                for part in parts_:
                    view = memoryview(part).cast("B")
                    digest.update(view)
                    f.write(view)
                f.write(digest.digest())
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        plain = self._path(block.hash, False)
        with self._lock:
            self._directory.files[path] = size
            self._directory.bytes += size
            self._note(path, size)
            if block.snapshot is not None and plain in self._directory.files:  # the block with its state replaces it
                self._directory.bytes -= self._directory.files.pop(plain)
                plain.unlink(missing_ok=True)
        if self.error is not None:
            log.info("prefix disk tier writes again", directory=str(self.config.directory))
            self.error = None
        self.counters.written_bytes += size
        self.counters.written_blocks += 1
        self._evict()
        self._on_change(self)

    def _fail(self, exc: OSError) -> None:
        if self.error is None:
            log.warning("prefix disk tier stops writing", directory=str(self.config.directory), error=str(exc))
        self.error = f"{type(exc).__name__}: {exc}"
        self._retry_at = time.monotonic() + RETRY_SECONDS
        self._on_change(self)

    def _evict(self, room: int = 0) -> None:
        """Delete the least recently used blocks until the directory is within ``maxBytes``
        with ``room`` bytes to spare."""
        while True:
            with self._lock:
                if self._directory.bytes + room <= self.config.max_bytes or not self._directory.files:
                    return
                path = next(iter(self._directory.files))
                self._directory.bytes -= self._directory.files.pop(path)
                entry = self._index.get(path.name.split(".")[0])
                if entry is not None and entry.path == path:
                    del self._index[path.name.split(".")[0]]
            path.unlink(missing_ok=True)
            self.counters.evicted_blocks += 1

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (an engine stopping); False if time ran out."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        self.flush()
        self._queue.put(None)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._directory.release()

    # -- reading ----------------------------------------------------------------

    def read(self, tokens: Sequence[int], first: int, last: int) -> Future:
        """Blocks ``first`` to ``last - 1`` of ``tokens``, read on the reader thread: a Future of
        the blocks read, in order, up to the first that is missing or refused."""
        hashes = chain(self.space, tokens, last, self.block)
        ids = np.asarray(tokens[: last * self.block], dtype=np.int64)
        return self._reader.submit(self._read, hashes, ids, first, last)

    def _read(self, hashes: list[str], ids: np.ndarray, first: int, last: int) -> list[ReadBlock]:
        blocks = []
        for j in range(first, last):
            with self._lock:
                entry = self._index.get(hashes[j])
            if entry is None:
                break
            try:
                data = entry.path.read_bytes()
                block = decode(data, self.space, hashes[j], ids[j * self.block:(j + 1) * self.block])
            except FileNotFoundError:  # another engine on this directory evicted it
                self._forget(entry)
                break
            except BlockError as exc:
                log.warning("prefix block refused", path=str(entry.path), kind=exc.kind, reason=str(exc))
                self.counters.refused[exc.kind] = self.counters.refused.get(exc.kind, 0) + 1
                self._forget(entry)
                entry.path.unlink(missing_ok=True)
                break
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("prefix block refused", path=str(entry.path), kind="corrupt", reason=str(exc))
                self.counters.refused["corrupt"] = self.counters.refused.get("corrupt", 0) + 1
                self._forget(entry)
                entry.path.unlink(missing_ok=True)
                break
            self.counters.read_bytes += len(data)
            self._touch(entry)
            blocks.append(block)
        self._on_change(self)
        return blocks

    def restored(self, tokens: int) -> None:
        """``tokens`` read from disk went into the RAM tree."""
        self.counters.hit_tokens += tokens
        self._on_change(self)

    def _forget(self, entry: _Entry) -> None:
        with self._lock:
            hash_ = entry.path.name.split(".")[0]
            if self._index.get(hash_) is entry:
                del self._index[hash_]
            size = self._directory.files.pop(entry.path, None)
            if size is not None:
                self._directory.bytes -= size

    def _touch(self, entry: _Entry) -> None:
        """A hit makes the block the most recently used, on disk too."""
        with self._lock:
            if entry.path in self._directory.files:
                self._directory.files[entry.path] = self._directory.files.pop(entry.path)
        try:
            os.utime(entry.path)
        except OSError:
            pass

    def status(self) -> dict:
        c = self.counters
        return {"path": str(self.config.directory), "maxBytes": self.config.max_bytes, "bytes": self.bytes,
                "blocks": len(self._directory.files), "blockTokens": self.block, "hitTokens": c.hit_tokens,
                "readBytes": c.read_bytes, "writtenBytes": c.written_bytes, "writtenBlocks": c.written_blocks,
                "droppedBlocks": c.dropped_blocks, "evictedBlocks": c.evicted_blocks,
                "refusedBlocks": dict(c.refused), "available": self.error is None, "error": self.error}


def default_max_bytes(directory: Path) -> int:
    """A quarter of the space free where the blocks go (what the tier may take unless the Model says)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free // 4


def block_columns(blocks: list[ReadBlock], lo: int, hi: int) -> Columns:
    """Positions [lo, hi) of consecutive blocks read back (counted from the first one's start),
    one piece per layer."""
    return [pair_slice(pair_concat(list(layer)), lo, hi) for layer in zip(*(b.columns for b in blocks))]


@dataclass
class _Read:
    future: Future
    first: int  # the first block read
    started: float


class DiskPrefixes:
    """A tree's disk tier as the scheduler uses it: what the tree records is written in blocks,
    and a request whose prompt starts with more blocks on disk than the tree holds waits while
    they are read, then finds them in the tree (one look, and at most one read, per request and
    admission).

    ``wake()`` is called from the reader thread when a read ends (the engine may be idle);
    ``report(tier, hit_tokens, seconds)`` after blocks are put into the tree."""

    def __init__(self, tier: DiskTier, tree, layers: int, wake: Callable[[], None],
                 report: Callable[[DiskTier, int, float], None] = lambda tier, hits, seconds: None):
        self.tier = tier
        self.tree = tree  # a ``prefix.PrefixTree``
        self.layers = layers  # attention layers: every node holds each one's columns
        self.wake = wake
        self.report = report
        self.reads: dict[object, _Read] = {}
        self.tried: set[object] = set()

    @property
    def block(self) -> int:
        return self.tier.block

    def recorded(self, tokens: Sequence[int], lo: int, hi: int, snapshot: Snapshot | None) -> None:
        """The tree now holds ``tokens[:hi]`` (it held ``tokens[:lo]``), with the recurrent state at
        ``hi`` if ``snapshot``: queue the blocks this completed that the disk lacks."""
        first, last = lo // self.block, hi // self.block
        if last <= first:
            return
        hashes = chain(self.tier.space, tokens, last, self.block)
        snapshot_at = last - 1 - first if snapshot is not None and hi == last * self.block else None
        missing = self.tier.missing(hashes[first:], snapshot_at)
        if not missing:
            return
        ids = np.asarray(tokens[:hi], dtype=np.int64)
        blocks = []
        for j in (first + m for m in missing):
            lo_j, hi_j = j * self.block, (j + 1) * self.block
            pieces, _ = self.tree.restore(tokens, [lo_j] * self.layers, hi_j)
            state = snapshot if j == last - 1 and snapshot_at is not None else None
            blocks.append(Block.of(hashes[j], ids[lo_j:hi_j], pieces, state))
        mx.eval([a for block in blocks for a in block.arrays()])
        for block in blocks:
            self.tier.save(block)

    def waits(self, key: object, tokens: Sequence[int], limit: int, cached: int) -> bool:
        """Whether ``key``'s request, whose ``tokens[:limit]`` may start from a cached prefix and
        ``cached`` of them are in the tree, waits for blocks being read from disk."""
        read = self.reads.get(key)
        if read is not None:
            if not read.future.done():
                return True
            del self.reads[key]
            self._insert(read, tokens, cached)
            return False
        if key in self.tried:  # looked once per admission: a queue of long prompts hashes each once
            return False
        self.tried.add(key)
        held = self.tier.held(tokens, limit)
        if held < cached + self.block:
            return False
        future = self.tier.read(tokens, cached // self.block, held // self.block)
        future.add_done_callback(lambda _: self.wake())
        self.reads[key] = _Read(future, cached // self.block, time.monotonic())
        return True

    def reading(self, key: object) -> bool:
        read = self.reads.get(key)
        return read is not None and not read.future.done()

    def _insert(self, read: _Read, tokens: Sequence[int], cached: int) -> None:
        """Put blocks read into the tree (unleased: they age like any other node)."""
        try:
            blocks = read.future.result()
        except Exception:
            log.exception("reading prefix blocks failed", directory=str(self.tier.config.directory))
            return
        if self.tier.stateful:
            while blocks and blocks[-1].snapshot is None:
                blocks.pop()
        if not blocks:
            return
        start, end = read.first * self.block, (read.first + len(blocks)) * self.block

        def columns(lo: int, hi: int) -> Columns | None:
            return block_columns(blocks, lo - start, hi - start) if lo >= start else None

        lease = self.tree.lease(tokens, start)
        try:
            self.tree.extend(lease, tokens, end, columns, blocks[-1].snapshot)
            depth = lease.depth
        finally:
            lease.release()
        if depth > cached:
            self.tier.restored(depth - cached)
            self.report(self.tier, depth - cached, time.monotonic() - read.started)

    def forget(self, key: object) -> None:
        """``key``'s request left (or started): a later admission may read again."""
        self.reads.pop(key, None)
        self.tried.discard(key)

    def close(self) -> None:
        self.tier.close()
