"""A node's cache of model files fetched from an object store, shared by the node's processes.

Layout, under ``<cache dir>/<node id>/`` (one folder per node, so nodes that share a
filesystem, as a local multi-node Ray cluster's do, still keep their copies apart)::

    stats.json                          downloads, download_bytes, hits, evictions (this node)
    <store key>/store.txt               the store's URL and endpoint (no credentials)
    <store key>/<model>/config.yaml     the model's files outside version folders (.head.json)
    <store key>/<model>/<version>/      one version's files, and .entry.json: every file's size
                                        and ETag as the store had them
    <store key>/<model>/.<version>.lock single flight: one process fetches, the others wait
    <store key>/<model>/.<version>.pin  a shared flock per process that uses the version

A version is downloaded into a temporary folder, each object checked against a HEAD before and
after its download (size and ETag equal: an object replaced meanwhile fails the fetch; a
multipart upload's ETag is no MD5 of the file, so ETags are compared, never computed), then
renamed into place with its ``.entry.json`` inside: a partial or failed download is never seen
under the version's name. The cache is bounded in bytes (``max_bytes``): before a download,
least recently used versions are evicted, never one pinned (a shared flock held by any process
of the node: a replica pins the versions it serves until it unloads them), and a version that
does not fit beside the pinned ones is refused (``OverBudget``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

from filelock import FileLock, Timeout

from .errors import LoadFault, OverBudget
from .files import write_atomic

ENTRY_FILENAME = ".entry.json"
HEAD_FILENAME = ".head.json"
STATS_FILENAME = "stats.json"
STATS = ("downloads", "download_bytes", "hits", "evictions")

# get(rel, dest): HEAD of <model>/<rel> after downloading it to dest (None: HEAD only)
Getter = Callable[[str, "Path | None"], Any]


def _safe_name(text: str) -> str:
    """``text`` as one folder name (a node id: hex in Ray; a host name otherwise)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip(".") or "node"


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class NodeCache:
    """This node's cache for one store (``store_key``), the byte bound covering every store's
    files on the node.

    Args:
        cache_dir: the cache folder (``TRT_SERVE_CACHE_DIR``); this node's is ``cache_dir/node``.
        node: this node's id.
        max_bytes: the bound of this node's cache.
        store_key: the store's folder name (a hash of its URL and endpoint).
        store_url: what ``store.txt`` and ``status`` name it by.
    """

    def __init__(self, cache_dir: Path, node: str, max_bytes: int, store_key: str, store_url: str) -> None:
        self.cache_dir = Path(cache_dir)
        self.node = node
        self.base = self.cache_dir / _safe_name(node)
        self.store_dir = self.base / store_key
        self.max_bytes = max_bytes
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if not (self.store_dir / "store.txt").is_file():
            write_atomic(self.store_dir / "store.txt", store_url + "\n")
        self._pins: dict[tuple[str, int], int] = {}  # (model, version) -> fd holding LOCK_SH

    def folder(self, name: str) -> Path:
        """Model ``name``'s folder in this node's cache."""
        return self.store_dir / name

    def complete(self, name: str, version: int) -> bool:
        """Whether version ``version`` of ``name`` is in the cache whole."""
        return (self.folder(name) / str(version) / ENTRY_FILENAME).is_file()

    # pins ---------------------------------------------------------------------------------

    def pin(self, name: str, version: int) -> None:
        """Hold a shared flock on the version's pin file (once per process): eviction skips it.
        Blocks while an eviction of it is under way."""
        if (name, version) in self._pins:
            return
        path = self.folder(name) / f".{version}.pin"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._pins[(name, version)] = fd

    def release(self, name: str, keep: Iterable[int] = ()) -> None:
        """Unpin ``name``'s versions but ``keep``."""
        keep = set(keep)
        for key in [k for k in self._pins if k[0] == name and k[1] not in keep]:
            os.close(self._pins.pop(key))

    def pinned(self) -> list[tuple[str, int]]:
        """(model, version) this process pins."""
        return sorted(self._pins)

    # fetching -----------------------------------------------------------------------------

    def use(self, name: str, version: int) -> bool:
        """Pin the version; True (a hit) when it is complete in the cache, else False (the pin
        stays: ``fetch_version`` fetches it)."""
        self.pin(name, version)
        if not self.complete(name, version):
            return False
        self._touch(name, version)
        self._count(hits=1)
        return True

    def fetch_head(self, name: str, files: dict[str, Any], get: Getter) -> None:
        """Bring the model's files outside version folders (``files``: rel -> ``FileInfo``, as
        listed) up to date: each one whose size or ETag differs from what ``.head.json``
        recorded is downloaded again (``_download``) and put in place by rename; one no longer
        listed is removed.

        Raises:
            LoadFault: a file changed while it was fetched, or came short.
            StoreUnavailable: the store did not answer.
        """
        folder = self.folder(name)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".head.lock")):
            record = _read_json(folder / HEAD_FILENAME) or {}
            want = {rel: [info.size, info.etag] for rel, info in files.items()}
            for rel, info in files.items():
                if record.get(rel) != want[rel] or not (folder / rel).is_file():
                    tmp = folder / f".{uuid.uuid4().hex}.tmp"
                    try:
                        self._download(name, rel, info, tmp, get)
                        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                        os.replace(tmp, folder / rel)
                    finally:
                        tmp.unlink(missing_ok=True)
            for rel in set(record) - set(files):
                (folder / rel).unlink(missing_ok=True)
            write_atomic(folder / HEAD_FILENAME, json.dumps(want, sort_keys=True))

    def fetch_version(self, name: str, version: int, files: dict[str, Any], get: Getter) -> bool:
        """Version ``version`` of ``name`` in the cache, pinned for this process: what is there
        when its ``.entry.json`` records exactly ``files`` (rel -> ``FileInfo``, as listed: a
        hit), else downloaded once for the node (a file lock: other processes wait and then
        find it) into a temporary folder renamed into place. Returns True for a download.

        Raises:
            OverBudget: it does not fit in ``max_bytes`` beside the pinned versions.
            LoadFault: an object changed while it was fetched, or came short.
            StoreUnavailable: the store did not answer.
        """
        folder = self.folder(name)
        folder.mkdir(parents=True, exist_ok=True)
        want = {rel: [info.size, info.etag] for rel, info in files.items()}
        with FileLock(str(folder / f".{version}.lock")):
            self.pin(name, version)
            entry = folder / str(version)
            record = _read_json(entry / ENTRY_FILENAME)
            if record is not None and record.get("files") == want:
                self._touch(name, version)
                self._count(hits=1)
                return False
            need = sum(info.size for info in files.values())
            self._make_room(need, (name, version))
            tmp = folder / f".{version}.{uuid.uuid4().hex}.tmp"
            trash = folder / f".{version}.{uuid.uuid4().hex}.old"
            try:
                for rel, info in sorted(files.items()):
                    inside = rel.split("/", 1)[1]
                    dest = tmp / inside
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    self._download(name, rel, info, dest, get)
                write_atomic(tmp / ENTRY_FILENAME, json.dumps({"files": want, "bytes": need}, sort_keys=True))
                if entry.exists():  # a version whose objects changed in the store
                    os.rename(entry, trash)
                os.rename(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(trash, ignore_errors=True)
            self._count(downloads=1, download_bytes=need)
            return True

    def _download(self, name: str, rel: str, listed: Any, dest: Path, get: Getter) -> None:
        """Download ``<model>/<rel>`` to ``dest``, checked: a HEAD before equal to ``listed``, the
        file's bytes equal to its size, a HEAD after equal to the one before.

        Raises:
            LoadFault: it changed since it was listed or while it downloaded, or came short.
        """
        before = get(rel, None)
        if before != listed:
            raise LoadFault(f"model '{name}': {rel} changed in the model store since it was listed "
                            f"(size {listed.size} -> {before.size}); load it again")
        after = get(rel, dest)
        got = dest.stat().st_size if dest.is_file() else 0
        if got != before.size:
            raise LoadFault(f"model '{name}': {rel} came short from the model store ({got} of {before.size} bytes); "
                            "nothing was loaded from it")
        if after != before:
            raise LoadFault(f"model '{name}': {rel} changed in the model store while it downloaded (ETag "
                            f"{before.etag} -> {after.etag}); load it again")

    # bound --------------------------------------------------------------------------------

    def _entries(self) -> list[tuple[Path, int, float]]:
        """(version folder, bytes, last use) of every complete version on this node."""
        found = []
        for record in self.base.glob(f"*/*/*/{ENTRY_FILENAME}"):
            folder = record.parent
            found.append((folder, _folder_bytes(folder), record.stat().st_mtime))
        return found

    def _make_room(self, need: int, fetching: tuple[str, int]) -> None:
        """Evict unpinned versions, least recently used first, until ``need`` more bytes fit.

        Raises:
            OverBudget: they do not fit beside the pinned versions.
        """
        with FileLock(str(self.base / ".lock")):
            entries = self._entries()
            used = sum(b for _, b, _ in entries)
            for folder, size, _ in sorted(entries, key=lambda e: e[2]):
                if used + need <= self.max_bytes:
                    break
                if folder == self.folder(fetching[0]) / str(fetching[1]):
                    continue
                if self._evict(folder):
                    used -= size
            if used + need > self.max_bytes:
                raise OverBudget(
                    f"model '{fetching[0]}' version {fetching[1]}: {need} bytes do not fit in this node's model "
                    f"cache ({used} of {self.max_bytes} bytes, TRT_SERVE_CACHE_MAX_BYTES, held by versions that "
                    "replicas on this node serve); unload a model or raise the bound")

    def _evict(self, folder: Path) -> bool:
        """Remove version ``folder`` unless a process pins it or fetches it; True if removed."""
        model, version = folder.parent, folder.name
        try:
            lock = FileLock(str(model / f".{version}.lock"), timeout=0)
            lock.acquire()
        except Timeout:
            return False
        try:
            fd = os.open(model / f".{version}.pin", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                trash = model / f".{version}.{uuid.uuid4().hex}.old"
                os.rename(folder, trash)
                shutil.rmtree(trash, ignore_errors=True)
            finally:
                os.close(fd)
        finally:
            lock.release()
        self._count(evictions=1)
        return True

    # bookkeeping --------------------------------------------------------------------------

    def _touch(self, name: str, version: int) -> None:
        try:
            os.utime(self.folder(name) / str(version) / ENTRY_FILENAME)
        except FileNotFoundError:
            pass

    def _count(self, **added: int) -> None:
        with FileLock(str(self.base / ".stats.lock")):
            stats = _read_json(self.base / STATS_FILENAME) or {}
            for key, value in added.items():
                stats[key] = stats.get(key, 0) + value
            write_atomic(self.base / STATS_FILENAME, json.dumps(stats, sort_keys=True))

    def stats(self) -> dict[str, int]:
        """This node's ``downloads``, ``download_bytes``, ``hits`` and ``evictions``."""
        return _stats(self.base)

    def status(self) -> dict[str, Any]:
        """What is cached where: per node folder under the cache folder (one per node that
        shares this filesystem; on separate disks, this node's), its bytes, bound, counts and
        versions (store, model, version, bytes, whether a process pins it)."""
        nodes = []
        for base in sorted(p for p in self.cache_dir.iterdir() if p.is_dir()):
            entries: list[dict[str, Any]] = []
            for record in sorted(base.glob(f"*/*/*/{ENTRY_FILENAME}")):
                folder = record.parent
                store = (folder.parents[1] / "store.txt")
                entries.append({"store": store.read_text().strip() if store.is_file() else folder.parents[1].name,
                                "model": folder.parent.name, "version": int(folder.name),
                                "bytes": _folder_bytes(folder), "pinned": _is_pinned(folder)})
            nodes.append({"node": base.name, "bytes": sum(e["bytes"] for e in entries), "max_bytes": self.max_bytes,
                          **_stats(base), "entries": entries})
        return {"cache_dir": str(self.cache_dir), "node": _safe_name(self.node), "nodes": nodes}


def _stats(base: Path) -> dict[str, int]:
    """The counts of node folder ``base`` (``STATS``; 0 for one not counted yet)."""
    stats = _read_json(base / STATS_FILENAME) or {}
    return {key: int(stats.get(key, 0)) for key in STATS}


def _is_pinned(folder: Path) -> bool:
    path = folder.parent / f".{folder.name}.pin"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
