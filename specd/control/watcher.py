"""``--manifests DIR``: files own the objects they declare, and the store follows them
(as ``specd serve`` owns the objects its command line declares).

Each object applied from a file carries the annotation ``specd.dev/source-file``,
which only this watcher writes (``api.manifest.SERVER_ANNOTATIONS``): a client's apply of
the same object keeps it, and ``specd diff`` leaves it out.
Adding or editing a file applies its objects (all or none); objects the file
no longer declares, or whose file is gone, are deleted.  A file that does not
parse is reported (log and event) and its last good objects stay.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog
from watchfiles import awatch

from ..api.manifest import SOURCE_ANNOTATION, ManifestError, Resource, parse_documents, read_manifest_file
from ..store import Conflict, Store

log = structlog.get_logger(__name__)
MANIFEST_SUFFIXES = (".yaml", ".yml")


def manifest_files(directory: Path) -> list[Path]:
    return sorted(p.resolve() for p in directory.rglob("*") if p.suffix in MANIFEST_SUFFIXES and p.is_file())


def sync_owned(store: Store, owner: str, resources: list[Resource]) -> bool:
    """Make the objects ``owner`` (a manifest file, or ``specd serve``) declares exactly
    ``resources``: apply them, all or none, and delete those it declared before and no longer
    does. False (and a Conflict event) if another owner's object stands in the way."""
    items = [r.store_item(**{SOURCE_ANNOTATION: owner}) for r in resources]
    try:
        store.apply(items, server=True)  # the owner owns them, and their annotation
    except Conflict as err:
        store.record_event("File", owner, "Warning", "Conflict", str(err))
        return False
    declared = {(r.kind, r.name) for r in resources}
    for obj in store.list():
        if obj.annotations.get(SOURCE_ANNOTATION) == owner and (obj.kind, obj.name) not in declared:
            store.delete(obj.kind, obj.name)
    if resources:
        store.record_event("File", owner, "Normal", "Applied", f"{len(resources)} objects")
    return True


class ManifestDirectory:
    def __init__(self, directory: Path, store: Store):
        self.directory = directory.resolve()
        self.store = store

    def sync_file(self, path: Path) -> bool:
        """Make the store hold exactly what ``path`` declares; False if the file is
        invalid.  Never raises: one file's failure must not stop the others applying."""
        try:
            return self._sync_file(path)
        except Exception as err:
            log.exception("applying a manifest file failed", file=str(path))
            self.store.record_event("File", str(path), "Warning", "Failed", f"applying it failed: {err}"[:500])
            return False

    def _sync_file(self, path: Path) -> bool:
        owner = str(path)
        try:
            resources = parse_documents(read_manifest_file(path), owner) if path.exists() else []
        except ManifestError as err:
            log.error("invalid manifest file; keeping its last good objects", file=owner, error=str(err))
            self.store.record_event("File", owner, "Warning", "Invalid", str(err))
            return False
        return sync_owned(self.store, owner, resources)

    def sync_all(self) -> None:
        """At start: apply every file, and drop objects whose file has disappeared."""
        files = manifest_files(self.directory)
        for path in files:
            self.sync_file(path)
        known = {str(p) for p in files}
        prefix = str(self.directory)
        for obj in self.store.list():
            owner = obj.annotations.get(SOURCE_ANNOTATION)
            if owner and owner.startswith(prefix) and owner not in known:
                self.store.delete(obj.kind, obj.name)

    async def watch(self, stop: asyncio.Event) -> None:
        async for changes in awatch(self.directory, stop_event=stop, debounce=200, step=50):
            for path in sorted({Path(p).resolve() for _, p in changes}):
                if path.suffix in MANIFEST_SUFFIXES:
                    log.info("manifest file changed", file=str(path))
                    await asyncio.to_thread(self.sync_file, path)
