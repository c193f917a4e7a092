"""The model repository: one folder per model under a root (``engines/`` by default).

Lookups go through an in-memory index built once at start, so a request's model name never
reaches the filesystem: ``../x`` or ``a%2Fb`` is simply an unknown name (``ModelNotFound``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from .completion import complete_config, model_file_error, read_onnx_signature
from .config import ModelConfig, ModelConfigFile, completed_config, read_config_file
from .errors import ConfigError, ModelNotFound, unknown_model
from .files import file_sha256
from .store import CONFIG_FILENAME, MODEL_FILENAME, PBTXT_FILENAME, FileInfo, Store, is_version
from .triton_config import read_pbtxt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FolderConfig:
    """What a model folder's config file says: ``given`` (as written, to be completed), the
    file it was read from (``path``: ``config.yaml``, else ``config.pbtxt``, else the absent
    ``config.yaml``) and ``notes`` on what was ignored."""

    given: ModelConfigFile
    path: Path
    notes: tuple[str, ...] = ()


def read_folder_config(folder: Path) -> FolderConfig:
    """The config of model folder ``folder``: its ``config.yaml`` (``config.read_config_file``);
    without one, its Triton ``config.pbtxt`` (``triton_config.read_pbtxt``); without either,
    the folder's name alone. With both, ``config.yaml`` wins (it is this server's; the
    ``config.pbtxt`` may be kept for Triton) and a note says the other is not read.

    Raises:
        ConfigError: the file read is invalid; names it and the field.
    """
    yaml_path, pbtxt_path = folder / CONFIG_FILENAME, folder / PBTXT_FILENAME
    if pbtxt_path.is_file() and not yaml_path.is_file():
        given, notes = read_pbtxt(pbtxt_path)
        return FolderConfig(given, pbtxt_path, notes)
    notes = (f"{pbtxt_path}: not read: {yaml_path} is this server's config and wins (remove one of them "
             "to silence this)",) if pbtxt_path.is_file() else ()
    return FolderConfig(read_config_file(yaml_path), yaml_path, notes)


def local_file_identity(path: Path) -> str:
    """``sha256:<hex>`` of a local model file's content: what changes when it is replaced or
    written in place, and the same on every node that holds the same bytes (a shared volume, or
    a copy per node made at another time). Hashed once per file version in a process
    (``files.file_sha256``, keyed by size and mtime). ``sha256:missing`` for a file that cannot
    be read (the load that needs it names why)."""
    try:
        return f"sha256:{file_sha256(path)}"
    except OSError:
        return "sha256:missing"


@dataclass(frozen=True)
class ModelEntry:
    """A model found in the repository: its config, folder, version numbers on disk and the
    versions its ``version_policy`` serves (both ascending).

    ``files``: ``(version, identity)`` of each served version's ``model.onnx`` as this reading
    saw it (``local_file_identity``: its content's hash; or ``etag:<bytes>:<ETag>`` from an
    object store's listing): a reading of the same versions whose files were written since is
    another entry (another ``digest``), and a load of a local file checks it is still the one
    read (``ModelHost.load``), so a version's answers never change without a load."""

    config: ModelConfig
    path: Path
    versions: tuple[int, ...]
    served: tuple[int, ...] = ()
    files: tuple[tuple[int, str], ...] = ()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def latest(self) -> int:
        """The newest served version (the unversioned routes' version)."""
        return (self.served or self.versions)[-1]

    @property
    def config_digest(self) -> str:
        """A hash of the completed config alone (hex)."""
        dump = json.dumps(self.config.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(dump.encode()).hexdigest()[:16]

    @property
    def digest(self) -> str:
        """A hash of the completed config and the served model files' identities (``files``;
        hex): the identity of one reading of the folder, equal on every process that read the
        same ``config.yaml`` and model files."""
        dump = json.dumps({"config": self.config_digest, "files": self.files}, sort_keys=True)
        return hashlib.sha256(dump.encode()).hexdigest()[:16]

    def file_identity(self, version: int) -> str | None:
        """The identity of ``version``'s model file as this reading saw it (``files``); None
        where not recorded (a pipeline, an entry made outside ``ModelRepository``)."""
        return dict(self.files).get(version)

    def at(self, version: int) -> "ModelEntry":
        """This model served at ``version`` alone (what one engine loads)."""
        return replace(self, served=(version,))

    def key(self, version: int | None = None) -> str:
        """The cache / multiplexing key of ``version`` (the newest served by default): the model
        name for the newest served version, ``<name>@<version>`` for an older one."""
        version = self.latest if version is None else version
        return self.name if version == self.latest else f"{self.name}@{version}"

    def keys(self) -> dict[str, int]:
        """Key (``key``) -> version, for every served version."""
        return {self.key(v): v for v in (self.served or (self.latest,))}

    def onnx_path(self, version: int | None = None) -> Path:
        """Path of ``<version>/model.onnx`` (latest version by default)."""
        return self.path / str(self.latest if version is None else version) / MODEL_FILENAME

    def check_files(self) -> None:
        """Check that each served version's ``model.onnx`` reads as an ONNX model
        (``completion.read_onnx_signature``): what a replica does before this reading replaces
        the versions it serves, so that a missing, truncated or damaged file fails the load
        before anything is unloaded.

        Raises:
            InvalidModelFile, LoadFault: a file that is not ONNX, or is missing
                (``completion.model_file_error``: names the model and its file).
        """
        for version in self.served:
            if read_onnx_signature(self.onnx_path(version)) is None:
                raise model_file_error(self.name, self.onnx_path(version))


class ModelRepository:
    """Index of the model folders under ``root``: ``<model>/config.yaml`` (or a Triton
    ``<model>/config.pbtxt``: ``read_folder_config``) and/or integer version folders
    ``<model>/<version>/model.onnx``. ``root`` is a local folder or an object store's
    URL (``s3://bucket/prefix``, ``store.Store``): both are listed the same way; a remote
    model's files are read from this node's cache (``node``: its key, the Ray node id in a
    replica), fetched there first where they are missing.

    Each config is completed from the model file once, when its folder is read (at
    construction, or by ``read`` for a model added later): what ``config.yaml`` leaves out (the
    whole file may be absent) is filled from the newest served version's ``model.onnx``, and
    what it says is checked against every served version's (``completion``).

    A pipeline model has no version folders; it is served as version 1. The config's
    ``version_policy`` picks the served versions (default: the latest one, as Triton's).

    ``names`` restricts the index to those models (the rest of the folder is not read).
    ``require_versions=False`` indexes a model with no ``<version>/model.onnx`` too, with
    empty ``versions`` (the build command reports it per model).

    ``entries``: index these, read earlier (the application's build), instead of reading the
    folders now: a replica that starts later (a replacement, a scale-out) serves the config the
    application was deployed with, and a ``config.yaml`` edited since, even into an invalid
    one, cannot stop it (``read``, a load through model control, reads a folder again). A
    remote model's served versions are fetched into this node's cache (``Store.localize``).

    ``keep_files``: pin, in the node cache, the remote versions of every entry this index
    serves (a replica that loads models from them) until ``release`` or a newer reading of the
    model; otherwise (a router: it only describes them) they are pinned only while read.

    Raises:
        StoreUnavailable: at construction, a remote root that did not answer.
        ConfigError: at construction, for a missing root, a bad config (or one the model file
            contradicts), a model with no ``<version>/model.onnx`` (the message says to run
            ``make models``), or a name in ``names`` that has no folder (or no entry in
            ``entries``).
    """

    def __init__(self, root: str | Path, names: list[str] | None = None, *, require_versions: bool = True,
                 entries: list[ModelEntry] | None = None, node: str | None = None, keep_files: bool = False) -> None:
        self.store = Store(root, node)
        self.root = self.store.root
        self.require_versions = require_versions
        self.keep_files = keep_files
        if entries is not None:
            given = {e.name: e for e in entries}
            missing = sorted(set(names or ()) - given.keys())
            if missing:
                raise ConfigError(f"models {missing} were not read at build from {self.root}")
            self._entries = {}
            for n in (names if names is not None else sorted(given)):
                self._entries[n] = self.store.localize(given[n])
                self._kept(self._entries[n])
            return
        if not self.store.exists():
            raise ConfigError(f"model repository {self.root} does not exist")
        found: dict[str, ModelEntry] = {}
        folders = self.folders()
        if names is not None:
            missing = sorted(set(names) - set(folders))
            if missing:
                raise ConfigError(f"models {missing} have no folder with a {CONFIG_FILENAME} or a "
                                  f"<version>/{MODEL_FILENAME} in {self.root}")
            folders = [f for f in folders if f in names]
        for folder in folders:
            entry = self._read(folder)
            found[entry.name] = entry
            self._kept(entry)
        if not found:
            raise ConfigError(f"model repository {self.root} holds no model folder (<model>/{CONFIG_FILENAME} "
                              f"or <model>/<version>/{MODEL_FILENAME})")
        self._entries = found

    def _read(self, name: str, served: tuple[int, ...] | None = None) -> ModelEntry:
        """One model folder's entry: its config, completed from the model file and checked
        against it, and its version folders; ``served``: these versions (``peek``), not the
        ``version_policy``'s. A remote model's files are fetched into the node cache first:
        those outside version folders, then the served versions (pinned: ``_kept``)."""
        listing = self.store.listing(name)
        folder = self.store.fetch(listing, ())
        read = read_folder_config(folder)
        for note in read.notes:
            logger.warning("model '%s': %s", name, note)
        given, config_path = read.given, read.path
        misnamed = listing.zero_led_versions()
        if misnamed:
            raise ConfigError(f"{folder}: version folders {misnamed} are named with leading zeros; a version folder "
                              f"is named by its number ({[str(int(v)) for v in misnamed]}): rename them")
        versions = (1,) if given.pipeline else listing.versions
        if not versions and self.require_versions:
            plans = sorted(rel for rel in listing.files if rel.endswith("/model.plan"))
            raise ConfigError(
                f"{folder}: no <version>/{MODEL_FILENAME} found; " + (
                    f"a TensorRT plan alone ({', '.join(plans)}) is not served: this server builds its plans "
                    f"from the {MODEL_FILENAME} they come from (python -m deployments.runtime.tools.build); put it "
                    f"beside the plan" if plans else "run `make models` (python -m deployments.runtime.tools.prepare) "
                    "to fetch and generate the models"))
        if served is None:
            try:
                served = given.version_policy.select(versions) if versions else ()
            except ValueError as e:
                raise ConfigError(f"{config_path}: {e}") from None
        else:
            gone = sorted(set(served) - set(versions))
            if gone:
                raise ConfigError(f"{folder}: version folder(s) {gone} (<version>/{MODEL_FILENAME}) are gone; "
                                  f"versions on disk: {list(versions)}")
            served = tuple(sorted(served))
        if not given.pipeline:
            self.store.fetch(listing, served)
        if given.pipeline or not served:
            config = completed_config(given, {}, config_path)
        else:
            config = complete_config(given, config_path, [folder / str(v) / MODEL_FILENAME for v in reversed(served)])
        files = () if given.pipeline else tuple((v, _identity(listing.files.get(f"{v}/{MODEL_FILENAME}"),
                                                             folder / str(v) / MODEL_FILENAME)) for v in served)
        return ModelEntry(config=config, path=folder, versions=versions, served=served, files=files)

    def folders(self) -> list[str]:
        """Names of the model folders in the repository now, read or not: those holding a
        ``config.yaml`` or a ``<version>/model.onnx``.

        Raises:
            StoreUnavailable: a remote repository did not answer.
        """
        return self.store.folders()

    def _kept(self, entry: ModelEntry) -> None:
        """After ``entry`` was read: keep its served versions pinned in the node cache where
        this index keeps files (``keep_files``), its other versions unpinned; none otherwise."""
        self.store.release(entry.name, entry.served if self.keep_files else ())

    def release(self, name: str) -> None:
        """Unpin model ``name``'s versions in the node cache (a replica unloaded it): the cache
        may evict them; a later load pins them again (fetching them where they were evicted)."""
        self.store.release(name)

    def read(self, name: str) -> ModelEntry:
        """Read model ``name``'s folder again (a model added or changed after start), with the
        same validation as at start; on success the index serves the new entry, on failure it
        is left as it was.

        Raises: as ``peek``.
        """
        entry = self.peek(name)
        self._entries[name] = entry
        self._kept(entry)
        return entry

    def peek(self, name: str, served: tuple[int, ...] | None = None) -> ModelEntry:
        """Read model ``name``'s folder as ``read`` does, leaving the index as it is: for a
        caller that serves the new entry only once it is known to serve (``take``).
        ``served``: serve exactly these versions (another reading's ``served``: what a load
        named), not those the ``version_policy`` picks from the folders on disk now.

        Raises:
            ModelNotFound: no model folder ``<root>/<name>`` (``folders``; ``name`` is matched
                against the folder names on disk, never joined to a path unchecked).
            StoreUnavailable: a remote repository did not answer.
            OverBudget: a remote version does not fit in the node cache.
            ConfigError: a bad config (or one the model file contradicts), no version folder,
                or a version of ``served`` without one; names the file and field (or folder).
            InvalidModelFile, LoadFault: the config leaves fields to complete from a model file that is not ONNX or is missing.
        """
        folders = self.store.folders(name)
        if name not in folders:
            # the repository's path stays out: a client reads this (the load route's 404)
            raise ModelNotFound(f"no model folder '{name}' with a {CONFIG_FILENAME} or a <version>/{MODEL_FILENAME} "
                                f"in the model repository; folders: {folders}")
        entry = self._read(name, served)
        if not self.keep_files:
            self.store.release(name)
        return entry

    def take(self, entry: ModelEntry) -> None:
        """Serve ``entry`` from now on: one that ``peek`` gave, or that ``read`` gave another
        index of the same root, so that both describe the same reading of the folder."""
        self._entries[entry.name] = entry
        self._kept(entry)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[ModelEntry]:
        return [self._entries[n] for n in self.names()]

    def get(self, name: str, version: str | None = None) -> ModelEntry:
        """The entry for ``name``; with ``version``, check that it is a served version.

        Raises:
            ModelNotFound: unknown name, a version that does not exist, or one not served.
        """
        entry = self._entries.get(name)
        if entry is None:
            raise unknown_model(name, f"available models: {self.names()}")
        if version is not None:
            if not is_version(version) or int(version) not in entry.versions:
                raise unknown_model(name, f"model '{name}' has no version '{version}'; versions: "
                                    f"{list(entry.versions)}", version)
            if int(version) not in entry.served:
                raise unknown_model(name, f"version {version} of model '{name}' is not served; served "
                                    f"versions: {list(entry.served)} (version_policy in its config.yaml)", version)
        return entry


def _identity(listed: FileInfo | None, path: Path) -> str:
    """A served model file's identity (``ModelEntry.files``): the object store's ETag where the
    listing has one (the node cache's copy has a local time), else the local file's."""
    if listed is not None and listed.etag:
        return f"etag:{listed.size}:{listed.etag}"
    return local_file_identity(path)
