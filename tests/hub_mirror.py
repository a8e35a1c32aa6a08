"""A local Hugging Face Hub: model directories served over the Hub's HTTP protocol.

Tests have no internet, yet what they check is the real ``huggingface_hub`` client
talking to a hub (``snapshot_download`` with ``HF_ENDPOINT`` pointing here): repo
info, the tree listing, HEAD and GET on ``resolve`` with the headers the client
requires, Range requests, and the error codes it turns into exceptions. So this is
a real server on a loopback socket, not a mock: what a test sees is what the client
does against the Hub (plain HTTP; no Xet headers are sent, so no Xet path is taken).

What the client requires of ``HEAD /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``
(else FileMetadataError) and an ``ETag`` (or ``X-Linked-Etag``), which names the blob
in the cache. The size comes from ``X-Linked-Size`` or ``Content-Length``.

Resuming, as huggingface_hub 2.4 does it: each download writes to its own
``blobs/<etag>.<random>.incomplete``, so a killed process's partial file is never
resumed (the next run starts from byte 0 and the old file stays behind). Range is
sent only within one process, after a dropped connection, from the bytes it has
written, which it writes in 10 MiB chunks: ``cut_next`` stages that drop.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from aiohttp import web

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # listed with an ``lfs`` entry, as the Hub does
CHUNK = 1 << 20  # bytes per write when unthrottled


def hub_env(cache: Path, endpoint: str | None = None) -> dict[str, str]:
    """A daemon's environment for a hub: a Hugging Face cache of its own at ``cache``, online,
    with no token and no telemetry, and short timeouts; ``endpoint``: this mirror's URL."""
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_TOKEN": "", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    return env if endpoint is None else {**env, "HF_ENDPOINT": endpoint}


@dataclass(frozen=True)
class _File:
    path: Path
    size: int
    oid: str  # the git blob sha1 (of the LFS pointer for LFS files), as the Hub's tree lists it
    sha256: str | None  # LFS files only: the content's sha256, their ETag
    pointer_size: int

    @property
    def etag(self) -> str:
        return self.sha256 or self.oid

    def lfs(self) -> dict | None:
        return None if self.sha256 is None else {"oid": self.sha256, "size": self.size,
                                                 "pointerSize": self.pointer_size}


@dataclass(frozen=True)
class _Snapshot:
    commit: str
    files: dict[str, _File]  # repo path ("sub/x.json") -> file


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hash_file(path: Path, name: str) -> _File:
    data = path.read_bytes()
    if not name.endswith(LFS_SUFFIXES):
        return _File(path, len(data), _git_sha1(data), None, 0)
    sha256 = hashlib.sha256(data).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
    return _File(path, len(data), _git_sha1(pointer), sha256, len(pointer))


def _error(status: int, code: str, message: str, commit: str | None = None) -> web.Response:
    """An error as the Hub gives it: the client picks its exception by ``X-Error-Code``."""
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    if commit is not None:
        headers["X-Repo-Commit"] = commit  # lets the client cache an EntryNotFound per commit
    return web.json_response({"error": message}, status=status, headers=headers)


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` as [start, end); None when unsatisfiable."""
    unit, _, spec = header.partition("=")
    first, _, last = spec.split(",")[0].strip().partition("-")
    if unit.strip() != "bytes" or not (first or last) or not (first or "0").isdigit() or not (last or "0").isdigit():
        return None
    if not first:
        start, end = max(size - int(last), 0), size
    else:
        start, end = int(first), min(int(last) + 1, size) if last else size
    return (start, end) if start < end or (start == 0 and size == 0) else None


class HubMirror:
    """Serves ``repos`` (repo id -> local directory, one commit each) as a Hub on loopback (or a given address)."""

    tree_page_size: int = 1000  # entries per tree page (the Hub's); lower it to exercise the Link pagination

    def __init__(self, repos: dict[str, Path], bytes_per_second: float | None = None) -> None:
        self.repos = {repo_id: Path(d) for repo_id, d in repos.items()}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.range_requests: list[tuple[str, int]] = []  # (filename, start) of every GET resumed past 0
        self.bytes_sent: dict[str, int] = {}  # bytes of each file's content served, by filename
        self._rate = bytes_per_second
        self._cuts: dict[str, int] = {}
        self._hashes: dict[tuple[Path, int, int], _File] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.endpoint = ""

    def start(self, host: str = "127.0.0.1") -> str:
        """Serve on a free port of ``host`` (loopback, or the address a network namespace reaches)
        from a thread with its own event loop (so a synchronous test can drive the client
        meanwhile); returns the endpoint URL for ``HF_ENDPOINT``."""
        sock = socket.socket()
        sock.bind((host, 0))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hub-mirror", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(sock), self._loop).result(timeout=10)
        self.endpoint = f"http://{host}:{sock.getsockname()[1]}"
        return self.endpoint

    def stop(self) -> None:
        """Close the server (downloads in flight are cut after half a second) and its loop."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=15)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=10)
        loop.close()

    def set_rate(self, bytes_per_second: float | None) -> None:
        """Throttle file bodies (None: unthrottled); applies to downloads already in flight too."""
        self._rate = bytes_per_second

    def cut_next(self, filename: str, after_bytes: int) -> None:
        """Close the connection of the next GET of ``filename`` once ``after_bytes`` of its body
        are sent, as a dropped network would, so the client's resume (a GET with Range) runs;
        cut past 10 MiB, or the client has written nothing to resume from."""
        self._cuts[filename] = after_bytes

    async def _serve(self, sock: socket.socket) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def _shutdown(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
        await asyncio.get_running_loop().shutdown_default_executor()

    def _snapshot(self, repo_id: str) -> _Snapshot:
        """The directory as it is now; contents are hashed once per (path, size, mtime)."""
        root = self.repos[repo_id]
        files: dict[str, _File] = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            name = path.relative_to(root).as_posix()
            stat = path.stat()
            key = (path, stat.st_size, stat.st_mtime_ns)
            with self._lock:
                entry = self._hashes.get(key)
            if entry is None:
                entry = _hash_file(path, name)
                with self._lock:
                    self._hashes[key] = entry
            files[name] = entry
        listing = "".join(f"{name} {f.oid}\n" for name, f in files.items())
        return _Snapshot(hashlib.sha1(listing.encode()).hexdigest(), files)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        # The client quotes a revision whole ("refs%2Fpr%2F1"), so split the raw path before unquoting.
        parts = [unquote(p) for p in request.rel_url.raw_path.split("/")[1:]]
        if parts[:2] == ["api", "models"]:
            rest = parts[2:]
            split = 2 if len(rest) > 2 and rest[2] in ("revision", "tree") else 1
            if len(rest) > split and rest[split] in ("revision", "tree") and request.method == "GET":
                repo_id, kind, tail = "/".join(rest[:split]), rest[split], rest[split + 1:]
            elif request.method == "GET":
                repo_id, kind, tail = "/".join(rest), "revision", ["main"]
            else:
                return web.Response(status=405)
            if not tail:
                return _error(400, "BadRequest", "revision missing")
            snapshot = await self._resolve(repo_id, tail[0])
            if isinstance(snapshot, web.Response):
                return snapshot
            if kind == "revision":
                return self._repo_info(repo_id, snapshot)
            return self._tree(request, snapshot, "/".join(p for p in tail[1:] if p))
        split = 2 if len(parts) > 2 and parts[2] == "resolve" else 1
        if len(parts) < split + 3 or parts[split] != "resolve" or request.method not in ("GET", "HEAD"):
            return _error(404, "RepoNotFound", f"no route for {request.path}")
        repo_id, filename = "/".join(parts[:split]), "/".join(parts[split + 2:])
        snapshot = await self._resolve(repo_id, parts[split + 1])
        if isinstance(snapshot, web.Response):
            return snapshot
        file = snapshot.files.get(filename)
        if file is None:
            return _error(404, "EntryNotFound", f"{filename} not in {repo_id}", snapshot.commit)
        return await self._file(request, snapshot.commit, filename, file)

    async def _resolve(self, repo_id: str, revision: str) -> _Snapshot | web.Response:
        if repo_id not in self.repos:
            return _error(404, "RepoNotFound", f"Repository {repo_id} not found")
        snapshot = await asyncio.to_thread(self._snapshot, repo_id)
        if revision not in ("main", snapshot.commit):
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return snapshot

    def _repo_info(self, repo_id: str, snapshot: _Snapshot) -> web.Response:
        siblings = [{"rfilename": name, "size": f.size, "blobId": f.oid,
                     **({"lfs": {"sha256": f.sha256, "size": f.size, "pointerSize": f.pointer_size}}
                        if f.sha256 else {})}
                    for name, f in snapshot.files.items()]
        return web.json_response({"_id": snapshot.commit[:24], "id": repo_id, "modelId": repo_id,
                                  "author": repo_id.split("/")[0], "sha": snapshot.commit, "private": False,
                                  "gated": False, "disabled": False, "tags": [], "siblings": siblings})

    def _tree(self, request: web.Request, snapshot: _Snapshot, base: str) -> web.Response:
        recursive = request.query.get("recursive", "false").lower() in ("true", "1")
        prefix = f"{base}/" if base else ""
        under = [name for name in snapshot.files if name.startswith(prefix)]
        if base and not under:
            return _error(404, "EntryNotFound", f"{base} not in the repo", snapshot.commit)
        dirs: set[str] = set()
        entries = []
        for name in under:
            rel = name[len(prefix):].split("/")
            for depth in range(1, len(rel) if recursive else min(len(rel), 2)):
                dirs.add(prefix + "/".join(rel[:depth]))
            if recursive or len(rel) == 1:
                f = snapshot.files[name]
                entries.append({"type": "file", "oid": f.oid, "size": f.size, "path": name,
                                **({"lfs": f.lfs()} if f.sha256 else {})})
        folders = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                   for d in sorted(dirs)]
        listing = folders + entries
        start = int(request.query.get("cursor", "0"))
        end = start + self.tree_page_size
        headers = {}
        if end < len(listing):
            headers["Link"] = f'<{request.url.update_query(cursor=str(end))}>; rel="next"'
        return web.json_response(listing[start:end], headers=headers)

    async def _file(self, request: web.Request, commit: str, filename: str, file: _File) -> web.StreamResponse:
        headers = {"X-Repo-Commit": commit, "ETag": f'"{file.etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start, end, status = 0, file.size, 200
        if "Range" in request.headers:
            span = _byte_range(request.headers["Range"], file.size)
            if span is None:
                return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{file.size}"})
            (start, end), status = span, 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{file.size}"
        if request.method == "HEAD":
            return web.Response(status=status, headers={**headers, "Content-Length": str(end - start)})
        if start > 0:
            self.range_requests.append((filename, start))
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = end - start
        await response.prepare(request)
        cut = self._cuts.pop(filename, None)
        sent = 0
        try:
            with file.path.open("rb") as f:
                f.seek(start)
                while start + sent < end:
                    rate = self._rate
                    size = min(CHUNK if rate is None else max(1024, int(rate / 20)), end - start - sent)
                    if cut is not None:
                        size = min(size, cut - sent)
                    await response.write(f.read(size))
                    sent += size
                    self.bytes_sent[filename] = self.bytes_sent.get(filename, 0) + size
                    if cut is not None and sent >= cut:
                        assert request.transport is not None
                        request.transport.close()  # flushes what was written: the client sees a short body
                        break
                    if rate is not None:
                        await asyncio.sleep(size / rate)
        except ConnectionError:
            pass  # the client went away (a test killed it); aiohttp ends the response quietly
        return response
