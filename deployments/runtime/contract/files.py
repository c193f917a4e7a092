"""Files of the model repository: atomic writes and content hashes (sha256)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

_hash_lock = threading.Lock()
_hash_cache: dict[tuple[str, int, int], str] = {}


def write_atomic(path: Path, data: bytes | bytearray | memoryview | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file in the same folder
    and ``os.replace``: a reader sees the old file or the new one, never part of one. Creates
    the parent folders.

    Raises:
        OSError: the folder or the file cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file, cached per (path, size, mtime_ns) for this process.

    Raises:
        OSError: the file cannot be read (``FileNotFoundError`` when it does not exist).
    """
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _hash_lock:
        cached = _hash_cache.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    value = digest.hexdigest()
    with _hash_lock:
        _hash_cache[key] = value
    return value
