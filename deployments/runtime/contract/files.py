"""Files of the model repository: atomic writes, content hashes (sha256), and the version key
that caches of what is read from a file are keyed by."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path


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


def file_version(path: Path) -> tuple[str, int, int]:
    """``(resolved path, size, mtime_ns)``: a key that changes when the file is edited or
    replaced, for caching what is read from it once per process (``functools.lru_cache``).

    Raises:
        OSError: the file cannot be read (``FileNotFoundError`` when it does not exist).
    """
    st = Path(path).stat()
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file, cached per ``file_version`` for this process.

    Raises:
        OSError: the file cannot be read (``FileNotFoundError`` when it does not exist).
    """
    return _sha256(*file_version(path))


@functools.lru_cache(maxsize=None)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def shown_model_file(path: Path) -> str:
    """A model file's path relative to its repository, ``<model>/<version>/model.onnx``: what a
    client's error names (the repository's own location stays in the server log)."""
    path = Path(path)
    return "/".join(path.parts[-3:])
