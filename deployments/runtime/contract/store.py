"""Where the model repository's files are: a local folder, or an object store
(``s3://bucket/prefix``) whose files each node copies into its cache (``NodeCache``) before a
model is read from them. Both give the same ``Listing`` (a local folder walked, an object
store listed through fsspec's s3fs), so that ``ModelRepository`` finds folders and versions,
and picks the served ones, the same way in either.

An object store is reached with s3fs (botocore): endpoint and credentials come from the
standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_PROFILE``), never from the URL; errors name the
store's URL and endpoint and the exception's type, never its text (an S3 error body can carry
the access key id).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from .errors import ConfigError, LoadFault, StoreUnavailable

if TYPE_CHECKING:
    from .node_cache import NodeCache

MODEL_FILENAME = "model.onnx"
CONFIG_FILENAME = "config.yaml"
PBTXT_FILENAME = "config.pbtxt"  # a Triton model configuration (contract.triton_config)
SCHEMES = ("s3",)
# A version folder's name: its number in ASCII digits (str.isdigit() also accepts e.g. '²'), at
# most 9, without leading zeros (``07`` would be read as 7, whose folder is ``7``).
_VERSION = re.compile(r"0|[1-9][0-9]{0,8}")
_ZERO_LED = re.compile(r"0[0-9]{1,9}")
DEFAULT_CACHE_BYTES = 20 * 2**30


@dataclass(frozen=True)
class StoreOptions:
    """How an object store is read and cached, from the environment (``from_env``):

    - ``TRT_SERVE_CACHE_DIR``: the node cache's folder (default ``<tmp>/trt-serve-cache``);
      each node keeps its files under ``<dir>/<node id>/``.
    - ``TRT_SERVE_CACHE_MAX_BYTES``: the bound of one node's cache (default 20 GiB).
    - ``TRT_SERVE_STORE_ATTEMPTS``: tries per request to the store, with botocore's exponential
      backoff between them (default 3).
    - ``TRT_SERVE_STORE_TIMEOUT_S``: connect and read timeout of one try (default 10 s).
    """

    cache_dir: Path
    cache_max_bytes: int = DEFAULT_CACHE_BYTES
    attempts: int = 3
    timeout_s: float = 10.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "StoreOptions":
        env = os.environ if environ is None else environ
        try:
            return cls(cache_dir=Path(env.get("TRT_SERVE_CACHE_DIR") or Path(tempfile.gettempdir()) / "trt-serve-cache"),
                       cache_max_bytes=int(float(env.get("TRT_SERVE_CACHE_MAX_BYTES") or DEFAULT_CACHE_BYTES)),
                       attempts=max(1, int(env.get("TRT_SERVE_STORE_ATTEMPTS") or 3)),
                       timeout_s=float(env.get("TRT_SERVE_STORE_TIMEOUT_S") or 10.0))
        except ValueError as e:
            raise ConfigError(f"the model store's environment: {e} (TRT_SERVE_CACHE_MAX_BYTES and "
                              "TRT_SERVE_STORE_ATTEMPTS take integers, TRT_SERVE_STORE_TIMEOUT_S seconds)") from None


@dataclass(frozen=True)
class FileInfo:
    """One file of a store: bytes and ETag (the object's; None for a local file)."""

    size: int
    etag: str | None = None


@dataclass(frozen=True)
class Listing:
    """The files of one model folder: path relative to the folder -> ``FileInfo``."""

    name: str
    files: dict[str, FileInfo]

    def _model_folders(self) -> list[str]:
        """The folders directly holding a ``model.onnx``."""
        return [rel.split("/")[0] for rel in self.files if rel.endswith("/" + MODEL_FILENAME) and rel.count("/") == 1]

    @property
    def versions(self) -> tuple[int, ...]:
        """Version numbers (ascending) of its ``<version>/model.onnx`` files."""
        return tuple(sorted(int(folder) for folder in self._model_folders() if is_version(folder)))

    def zero_led_versions(self) -> list[str]:
        """Folders holding a ``model.onnx`` named by a number with leading zeros (``07``): not
        version folders (``is_version``), and no version folder is read from them."""
        return sorted(folder for folder in self._model_folders() if _ZERO_LED.fullmatch(folder))

    def version_files(self, version: int) -> dict[str, FileInfo]:
        """The files of version folder ``version`` (relative to the model folder)."""
        return {rel: info for rel, info in self.files.items() if rel.split("/")[0] == str(version)}

    def head_files(self) -> dict[str, FileInfo]:
        """The files outside the version folders (``config.yaml``, warm-up data)."""
        return {rel: info for rel, info in self.files.items() if not ("/" in rel and is_version(rel.split("/")[0]))}


def is_version(name: str) -> bool:
    """Whether folder ``name`` is a version folder's (its number: ASCII digits, at most 9, no
    leading zero)."""
    return bool(_VERSION.fullmatch(name))


def safe_relative(key: str, what: str) -> str:
    """``key`` as a relative POSIX path that stays under its folder.

    Raises:
        ConfigError: an absolute key, or one with an empty, ``.`` or ``..`` part, or a backslash
            (``what`` names where it was found).
    """
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"{what}: the key '{key}' would escape the model's folder (absolute, '..', '.' or an "
                          "empty part); refused")
    return str(PurePosixPath(*parts))


def endpoint_name(environ: Any) -> str:
    """The store's endpoint as messages name it: ``AWS_ENDPOINT_URL``'s scheme, host and port
    (never a user or password written into it), or "AWS S3" without one."""
    raw = environ.get("AWS_ENDPOINT_URL")
    if not raw:
        return "AWS S3"
    parts = urlsplit(raw)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def is_remote(root: str | Path) -> bool:
    """Whether ``root`` is a store URL (``scheme://...``) rather than a local folder."""
    return "://" in str(root)


class Store:
    """A model repository's files, listed through an fsspec filesystem: a local folder is read
    where it is; an object store's files are copied into this node's cache first
    (``fetch``). The index of a repository needs ``folders`` and ``listing``; reading a model
    needs ``fetch``.

    Args:
        root: a local folder, or ``s3://bucket[/prefix]``.
        node: this node's id (the Ray node id in a replica; default: the host name): the
            cache keeps each node's files apart, so nodes that share a filesystem still fetch
            once each.
        options: default ``StoreOptions.from_env()``.

    Raises:
        ConfigError: an unknown scheme, a URL that carries credentials, or a bad environment.
    """

    def __init__(self, root: str | Path, node: str | None = None, options: StoreOptions | None = None) -> None:
        self.remote = is_remote(root)
        self.cache: NodeCache | None = None
        if not self.remote:
            self.root: Path | str = Path(root).resolve()
            self.path = str(self.root)
            return
        url = str(root).rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ConfigError(f"model repository {url!r}: scheme '{parts.scheme}' is not supported; use a local "
                              f"folder or {', '.join(s + '://bucket/prefix' for s in SCHEMES)}")
        if "@" in parts.netloc or parts.query or parts.fragment:
            raise ConfigError("model repository: a store URL carries no credentials, query or fragment; give the "
                              "credentials in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")
        prefix = parts.path.strip("/")
        if prefix:
            safe_relative(prefix, f"model repository {parts.scheme}://{parts.netloc}")
        options = options or StoreOptions.from_env()
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs={
            "connect_timeout": options.timeout_s, "read_timeout": options.timeout_s,
            "retries": {"total_max_attempts": options.attempts, "mode": "standard"}})
        self.fs.retries = 1  # botocore retries (with backoff); s3fs's own loop would multiply them
        self.attempts = options.attempts
        self.root = url
        self.path = f"{parts.netloc}/{prefix}".rstrip("/")
        self.endpoint = endpoint_name(os.environ)
        from .node_cache import NodeCache

        key = hashlib.sha256(f"{self.endpoint}|{url}".encode()).hexdigest()[:12]
        self.cache = NodeCache(options.cache_dir, node or socket.gethostname(), options.cache_max_bytes,
                               store_key=key, store_url=f"{url} ({self.endpoint})")

    @property
    def where(self) -> str:
        """The store as messages name it: the folder, or URL and endpoint (no credentials)."""
        return str(self.root) if not self.remote else f"{self.root} (endpoint {self.endpoint})"

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, its store errors typed: ``FileNotFoundError`` passes; anything else from
        a remote store is ``StoreUnavailable`` naming ``what`` and the store."""
        if not self.remote:
            return call()
        try:
            return call()
        except FileNotFoundError:
            raise
        except PermissionError as e:
            raise StoreUnavailable(f"{what}: the model store {self.where} refused access ({type(e).__name__}); "
                                   "check the credentials in the environment") from None
        except Exception as e:
            raise StoreUnavailable(f"{what}: the model store {self.where} did not answer in {self.attempts} tries "
                                   f"({type(e).__name__}); models already loaded keep serving") from None

    def _find(self, path: str, what: str, maxdepth: int | None = None) -> dict[str, FileInfo]:
        """Files under ``path`` (relative key -> ``FileInfo``); ``{}`` when there is none. A
        local folder is walked following symbolic links (a version folder may be a link)."""
        if not self.remote:
            return _walk(Path(path), maxdepth)
        try:
            # one flat listing, filtered by depth here: s3fs's find with maxdepth walks level by
            # level through fsspec's walk, which drops the errors (a timeout read as no files)
            found = self._call(what, lambda: self.fs.find(path, detail=True))
        except FileNotFoundError:
            return {}
        files = {}
        for key, info in found.items():
            if info.get("type") != "file" or key.endswith("/"):
                continue
            rel = key[len(path.rstrip("/")) + 1:] if key.startswith(path.rstrip("/") + "/") else key
            if maxdepth is not None and rel.count("/") >= maxdepth:
                continue
            etag = info.get("ETag") or info.get("etag")
            files[rel] = FileInfo(int(info.get("size") or 0), etag.strip('"') if etag else None)
        return files

    def exists(self) -> bool:
        """Whether the root is a folder (local) or a listable bucket (remote).

        Raises:
            StoreUnavailable: the store did not answer.
        """
        if not self.remote:
            return Path(self.root).is_dir()
        bucket = self.path.split("/")[0]
        try:
            self._call(f"model repository {self.root}", lambda: self.fs.info(bucket))
        except FileNotFoundError:
            return False
        return True

    def folders(self, model: str | None = None) -> list[str]:
        """Names of the model folders now: those holding a ``config.yaml``, a ``config.pbtxt``
        or a ``<version>/model.onnx``; a remote key that would escape its folder is skipped.
        ``model``: the model whose read asks (an error names it).

        Raises:
            StoreUnavailable: the store did not answer.
        """
        names = set()
        what = f"model '{model}'" if model else "the repository's models"
        for rel in self._find(self.path, what, maxdepth=3):
            parts = rel.split("/")
            if (len(parts) == 2 and parts[1] in (CONFIG_FILENAME, PBTXT_FILENAME)) or (
                    len(parts) == 3 and (is_version(parts[1]) or _ZERO_LED.fullmatch(parts[1]))
                    and parts[2] == MODEL_FILENAME):  # a zero-led one: its read says how to name it
                names.add(parts[0])
        return sorted(n for n in names if n not in ("", ".", "..") and not n.startswith("."))

    def listing(self, name: str) -> Listing:
        """The files of model folder ``name``.

        Raises:
            ConfigError: a remote key that would escape the folder (``safe_relative``).
            StoreUnavailable: the store did not answer.
        """
        files = self._find(f"{self.path}/{name}", f"model '{name}'")
        if self.remote:
            for rel in files:
                safe_relative(rel, f"model '{name}' in {self.root}")
        return Listing(name, files)

    def local(self, name: str) -> Path:
        """The local folder model ``name`` is read from (remote: in this node's cache; what
        ``fetch`` has put there)."""
        if not self.remote:
            return Path(self.root) / name
        assert self.cache is not None
        return self.cache.folder(name)

    def fetch(self, listing: Listing, versions: Iterable[int]) -> Path:
        """The local folder of ``listing``'s model, holding its files outside version folders
        and version folders ``versions``: a local folder as it is; a remote one's files fetched
        into this node's cache where they are not there already (``NodeCache.fetch_version``),
        each version pinned for this process until ``release``.

        Raises:
            StoreUnavailable: the store did not answer.
            LoadFault: an object changed, went or came truncated while it was fetched, or a
                version has no files.
            OverBudget: a version does not fit in the cache beside those pinned.
        """
        if not self.remote:
            return Path(self.root) / listing.name
        assert self.cache is not None
        name = listing.name
        self.cache.fetch_head(name, listing.head_files(), self._getter(name))
        for version in versions:
            files = listing.version_files(version)
            if not files:
                raise LoadFault(f"model '{name}': version {version} is gone from the model store {self.where}")
            self.cache.fetch_version(name, version, files, self._getter(name))
        return self.cache.folder(name)

    def localize(self, entry: Any) -> Any:
        """``entry`` (a ``repository.ModelEntry`` read at build, perhaps on another node) with its files on this node: a
        remote model's served versions pinned, and fetched into this node's cache unless they
        are whole there already (then the store is not asked at all).

        Raises:
            as ``fetch``.
        """
        if not self.remote:
            return entry
        assert self.cache is not None
        name = entry.name
        needed = [v for v in entry.served if not self.cache.use(name, v)]
        if needed or not any((self.cache.folder(name) / f).is_file() for f in (CONFIG_FILENAME, PBTXT_FILENAME)):
            self.fetch(self.listing(name), needed)
        return replace(entry, path=self.cache.folder(name))

    def release(self, name: str, keep: Iterable[int] = ()) -> None:
        """Unpin model ``name``'s versions but ``keep`` in this process (remote; a local
        store pins nothing)."""
        if self.cache is not None:
            self.cache.release(name, keep)

    def _getter(self, name: str) -> "Callable[[str, Path | None], FileInfo]":
        """``get(rel, dest)``: a HEAD of ``<model>/<rel>`` (its ``FileInfo``), and with ``dest``
        the object downloaded to ``dest`` first."""
        base = f"{self.path}/{name}"

        def get(rel: str, dest: Path | None) -> FileInfo:
            key = f"{base}/{rel}"
            what = f"model '{name}': {rel}"
            try:
                if dest is not None:
                    self._call(what, lambda: self.fs.get_file(key, str(dest)))
                info = self._call(what, lambda: self.fs.info(key))
            except FileNotFoundError:
                raise LoadFault(f"model '{name}': {rel} is gone from the model store {self.where}") from None
            etag = info.get("ETag") or info.get("etag")
            return FileInfo(int(info.get("size") or 0), etag.strip('"') if etag else None)

        return get

    def status(self) -> dict[str, Any] | None:
        """The node caches under the cache folder (``NodeCache.status``); None for a local folder."""
        return None if self.cache is None else self.cache.status()


def _walk(folder: Path, maxdepth: int | None) -> dict[str, FileInfo]:
    """The files under local ``folder`` (relative POSIX path -> ``FileInfo``), at most
    ``maxdepth`` levels down, symbolic links followed."""
    files: dict[str, FileInfo] = {}
    for top, dirs, names in os.walk(folder, followlinks=True):
        depth = len(Path(top).relative_to(folder).parts)
        if maxdepth is not None and depth + 1 >= maxdepth:
            dirs[:] = []
        for name in names:
            path = Path(top) / name
            try:
                files[path.relative_to(folder).as_posix()] = FileInfo(path.stat().st_size)
            except OSError:  # a dangling link
                continue
    return files
