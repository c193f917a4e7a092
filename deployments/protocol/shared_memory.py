"""Triton's system and CUDA shared-memory extensions, free of HTTP and Ray: the registration of a
region (``Registry``: register, status, unregister over a ``RegionStore``) and an infer request's
use of one (``SharedMemory``: inputs read from a region, outputs written into one).

Source: Triton Inference Server, docs/protocol/extension_shared_memory.md; error texts from
src/shared_memory_manager.cc, src/common.cc (``ValidateSharedMemoryKey``) and src/http_server.cc.

A region is registered by name, in one namespace for system and CUDA regions. A system region is
``byte_size`` bytes at ``offset`` of the POSIX shared-memory object ``key`` (the file
``/dev/shm/<key without its leading '/'>`` on Linux, where ``shm_open`` puts it); a CUDA region
is a ``cudaIpcMemHandle_t`` (base64) on GPU ``device_id``. An input whose ``parameters`` carry
``shared_memory_region``, ``shared_memory_byte_size`` (and optionally ``shared_memory_offset``,
within the region) has no data in the body: it is read from the region; an output whose
parameters carry them is written into the region and answered without data, those parameters
echoed.

Where registrations live is the ``RegionStore``'s business (``deployments.regions``: Ray's GCS
key-value store, read by every replica of the cluster when a request names a region: its
generation once a request, a region's record once a generation, ``RegionCache``). A system
region's object is opened at its key for each read or write, checked to be the object the region
was registered over (device and inode, recorded at register), and read with ``pread`` into a
buffer of the request's own (an input is a copy) or written with ``pwrite``; it is never mapped,
since the client owns it and may shrink, truncate, replace or remove it at any moment, and a
mapped page past the object's end faults (SIGBUS kills the process) where ``pread`` returns
fewer bytes: such a request is answered 400, naming the region, offset and size, and the process
serves on. A client that unregisters, removes its object, creates a new one at the same key and
registers the same name (Triton's HTTP and gRPC shm examples, one after another) gets the new
object read and written; an object replaced at its key without a new register is refused (400),
as is a key that names another node's object. A CUDA region's handle is opened once per process,
on first use, and closed once the region is unregistered (``SharedMemory.sweep``).

The server's host is the client's: a key names a file of this node's ``/dev/shm`` directly (no
``/`` after its leading ones, not ``.`` or ``..``), so no request reaches another file.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import os
import stat
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Protocol

import numpy as np

from ..runtime.backends.cuda_ipc import IpcOpenings
from ..runtime.contract.datatypes import NUMPY_BY_DATATYPE, datatype_of
from ..runtime.contract.device import DeviceOutput, DeviceTensor, not_on_gpu, output_too_small
from ..runtime.contract.errors import RegionNotFound, SharedMemoryError
from .parameters import SHARED_MEMORY_PARAMETERS

if TYPE_CHECKING:
    from .v2 import InferRequest

SHM_ROOT = Path("/dev/shm")
SYSTEM, CUDA = "system", "cuda"
KINDS = {SYSTEM: "system shared memory", CUDA: "CUDA shared memory"}
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
RESERVED_PREFIX = "triton_python_backend_shm_region_"  # Triton's kTritonSharedMemoryRegionPrefix
MAX_NAME_CHARS = 255  # a region name or key: NAME_MAX of the file a key names
REGION, BYTE_SIZE, OFFSET = PARAMETERS = SHARED_MEMORY_PARAMETERS


@dataclass(frozen=True)
class Region:
    """A registered region. ``kind``: ``system`` or ``cuda``; ``key`` and ``offset`` (bytes into
    the key's object) for a system region, with ``dev`` and ``ino``, the object's ``st_dev`` and
    ``st_ino`` when it was registered (0: not recorded, a registration of an older server),
    ``device_id`` and ``raw_handle`` (base64 of the ``cudaIpcMemHandle_t``) for a CUDA one;
    ``byte_size``: its size in bytes."""

    name: str
    kind: str
    byte_size: int
    key: str = ""
    offset: int = 0
    device_id: int = 0
    raw_handle: str = ""
    dev: int = 0
    ino: int = 0

    def status(self) -> dict[str, Any]:
        """Triton's status object: ``{"name", "key", "offset", "byte_size"}`` for a system
        region, ``{"name", "device_id", "byte_size"}`` for a CUDA one."""
        if self.kind == SYSTEM:
            return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Region":
        """The region ``to_json`` wrote, by this server or another version of it: a field it
        lacks takes its default, one it does not know is left out (registrations outlive a
        ``serve deploy``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


class RegionStore(Protocol):
    """Where the registered regions live, shared by every process that serves requests."""

    def get(self, name: str) -> Region | None: ...

    def add(self, region: Region) -> bool:
        """Store ``region`` unless its name is taken; returns whether it was stored (and then,
        after storing it, changes the ``generation``)."""
        ...

    def remove(self, name: str) -> None:
        """Remove region ``name``, then change the ``generation``."""
        ...

    def regions(self) -> list[Region]: ...

    def generation(self) -> bytes | None:
        """A token that every ``add`` and ``remove`` changes once it has changed the regions (a
        new random one each time, never a value seen before; None: none written yet)."""
        ...


Lookup = Callable[[str], "Region | None"]  # the registered regions by name (``RegionCache.lookup``)


class RegionCache:
    """A process's copy of the region records of ``store`` (only those its requests named), good
    for one store ``generation``: a request reads the generation once (``lookup``), then each
    region it names from the copy, from the store only on the first use of a region since
    the generation changed. A register or unregister through any process changes the
    generation before it answers, so the next request everywhere reads the store again; a
    region not registered is not kept (it is read again each time it is named)."""

    def __init__(self, store: RegionStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._generation: bytes | None | object = _UNREAD
        self._regions: dict[str, Region] = {}

    def lookup(self) -> Callable[[str], Region | None]:
        """The regions as of now, by name (one read of the store's generation here; a region's
        record read from the store at most once per generation)."""
        generation = self.store.generation()
        with self._lock:
            if generation != self._generation:
                self._generation, self._regions = generation, {}
        return functools.partial(self._get, generation)

    def _get(self, generation: bytes | None, name: str) -> Region | None:
        with self._lock:
            if generation == self._generation and name in self._regions:
                return self._regions[name]
        region = self.store.get(name)  # read after the generation: as new as it, or newer
        with self._lock:
            if region is not None and generation == self._generation:
                self._regions[name] = region
        return region


_UNREAD = object()  # RegionCache's generation before the store's is read


def check_region_name(name: str) -> str:
    """``name`` if it can name a region: non-empty, at most ``MAX_NAME_CHARS``, no ``/`` or NUL.

    Raises:
        SharedMemoryError: another name.
    """
    if not name or len(name) > MAX_NAME_CHARS or "/" in name or "\x00" in name:
        raise SharedMemoryError(f"invalid shared memory region name {json.dumps(name)[:80]}: a region name is "
                                f"1 to {MAX_NAME_CHARS} characters, without '/' or NUL")
    return name


def key_path(name: str, key: str) -> Path:
    """The file of ``/dev/shm`` that ``key`` (``shm_open``'s name: leading ``/`` optional) names,
    for a region ``name`` (messages).

    Raises:
        SharedMemoryError: a key that is all slashes (Triton's words), that would name a file
            outside ``/dev/shm`` (a ``/`` after its leading ones, ``.`` or ``..``, NUL), or that
            holds Triton's reserved prefix (Triton's words).
    """
    stripped = key.lstrip("/")
    if not stripped or stripped in (".", "..") or "/" in stripped or "\x00" in stripped \
            or len(stripped) > MAX_NAME_CHARS:
        raise SharedMemoryError(
            f"cannot register shared memory region '{name}' - invalid shm key '{key[:MAX_NAME_CHARS]}'; a key names "
            f"an object directly in {SHM_ROOT} ('/name' or 'name'): no '/' after its leading ones, not '.' or "
            f"'..', at most {MAX_NAME_CHARS} characters")
    if stripped.startswith(RESERVED_PREFIX):
        raise SharedMemoryError(f"cannot register shared memory region '{name}' with key '{key}' as the key "
                                f"contains the reserved prefix '{RESERVED_PREFIX}'")
    return SHM_ROOT / stripped


def _uint(where: str, body: Mapping[str, Any], field: str, default: int | None = None) -> int:
    """``body[field]``, a non-negative integer (``default`` when absent; None: required)."""
    if field not in body and default is not None:
        return default
    if field not in body:
        raise SharedMemoryError(f"Shared memory register request has no '{field}' field; {where} needs "
                                f"{{\"key\", \"offset\", \"byte_size\"}} (system) or "
                                f"{{\"raw_handle\": {{\"b64\"}}, \"device_id\", \"byte_size\"}} (CUDA)")
    value = body[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SharedMemoryError(f"{where}: '{field}' must be a non-negative integer, got {json.dumps(value)[:40]}")
    return value


def _register_body(name: str, body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise SharedMemoryError(f"the register request of shared memory region '{name}' must be a JSON object")
    return body


def system_region(name: str, body: Any) -> Region:
    """A system region from its register request ``{"key", "offset" (optional, 0), "byte_size"}``,
    checked as Triton checks it: the key names an object of this node's ``/dev/shm`` that holds
    ``offset + byte_size`` bytes.

    Raises:
        SharedMemoryError: a missing or malformed field, a bad key (``key_path``), an object that
            cannot be opened or is too small (Triton's words, then ours).
    """
    check_region_name(name)
    body = _register_body(name, body)
    where = f"the register request of shared memory region '{name}'"
    key = body.get("key")
    if "key" not in body:
        raise SharedMemoryError("Shared memory register request has no 'key' field")
    if not isinstance(key, str):
        raise SharedMemoryError(f"{where}: 'key' must be a string, got {json.dumps(key)[:40]}")
    offset, byte_size = _uint(where, body, "offset", 0), _uint(where, body, "byte_size")
    if byte_size == 0:
        raise SharedMemoryError(f"failed to register shared memory region '{name}': invalid args; byte_size is 0, "
                                "a region holds at least one byte")
    path = key_path(name, key)
    status = _object_status(path, key)
    if offset + byte_size > status.st_size:
        raise SharedMemoryError(
            f"failed to register shared memory region '{name}': invalid args; offset {offset} + byte_size "
            f"{byte_size} = {offset + byte_size} bytes, and the object of key '{key}' holds {status.st_size} bytes")
    return Region(name, SYSTEM, byte_size, key=key, offset=offset, dev=status.st_dev, ino=status.st_ino)


def _object_status(path: Path, key: str) -> os.stat_result:
    """The status of the shared-memory object at ``path``, a regular file (a symbolic link is not
    followed, as glibc's ``shm_open`` opens with ``O_NOFOLLOW``: a link in ``/dev/shm`` must not
    lead the server to read or write another file).

    Raises:
        SharedMemoryError: it cannot be opened here (Triton's words, then why).
    """
    try:
        status = path.lstat()
    except OSError:
        raise SharedMemoryError(
            f"Unable to open shared memory region: '{key}'; {path} does not exist on this node: create it "
            "first (tritonclient.utils.shared_memory.create_shared_memory_region), on the server's host") from None
    if not stat.S_ISREG(status.st_mode):
        raise SharedMemoryError(f"Unable to open shared memory region: '{key}'; {path} is not a shared-memory "
                                "object (a symbolic link or a folder)")
    return status


def cuda_region(name: str, body: Any) -> Region:
    """A CUDA region from its register request ``{"raw_handle": {"b64": ...}, "device_id",
    "byte_size"}``. The handle is opened where a model uses it (a replica that runs the model on
    that GPU), not here: this checks its form (a base64 ``cudaIpcMemHandle_t`` of 64 bytes).

    Raises:
        SharedMemoryError: a missing or malformed field (Triton's words where it has them).
    """
    check_region_name(name)
    body = _register_body(name, body)
    where = f"the register request of CUDA shared memory region '{name}'"
    if "raw_handle" not in body:
        raise SharedMemoryError("Shared memory register request has no 'raw_handle' field")
    raw = body["raw_handle"]
    b64 = raw.get("b64") if isinstance(raw, dict) else None
    try:
        handle = base64.b64decode(b64, validate=True) if isinstance(b64, str) else b""
    except (binascii.Error, ValueError):
        handle = b""
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        raise SharedMemoryError(f"'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t; {where}: "
                                f"raw_handle is {{\"b64\": <base64 of the {CUDA_IPC_HANDLE_BYTES}-byte handle>}}")
    device_id, byte_size = _uint(where, body, "device_id"), _uint(where, body, "byte_size")
    return Region(name, CUDA, byte_size, device_id=device_id, raw_handle=b64)


class Registry:
    """Triton's register, status and unregister over a ``RegionStore``; ``forget(region)`` is
    told of each region unregistered here (this process's ``SharedMemory.forget``: unmap it)."""

    def __init__(self, store: RegionStore, forget: Callable[[Region], None] | None = None) -> None:
        self.store = store
        self.forget = forget

    def register(self, kind: str, name: str, body: Any) -> None:
        """Register region ``name`` of ``kind`` from its register request ``body`` (parsed JSON).

        Raises:
            SharedMemoryError: as ``system_region`` / ``cuda_region``; the name is taken
                (Triton's words).
        """
        region = system_region(name, body) if kind == SYSTEM else cuda_region(name, body)
        if not self.store.add(region):
            raise SharedMemoryError(f"shared memory region '{name}' already in manager; unregister it first "
                                    f"(POST /v2/{_route(kind)}/region/{name}/unregister)")

    def unregister(self, kind: str, name: str | None = None) -> None:
        """Unregister region ``name`` of ``kind``, or every region of ``kind`` (None). A name not
        registered, or registered as the other kind, is left as it is without error (Triton)."""
        for region in self.store.regions() if name is None else [self.store.get(name)]:
            if region is not None and region.kind == kind:
                self.store.remove(region.name)
                if self.forget is not None:
                    self.forget(region)

    def status(self, kind: str, name: str | None = None) -> list[dict[str, Any]]:
        """Triton's status: every region of ``kind`` (``name`` None), or region ``name``.

        Raises:
            RegionNotFound: ``name`` is not registered, or is of the other kind (Triton's words).
            SharedMemoryError: ``name`` is one no region can have (``check_region_name``).
        """
        if name is None:
            return [r.status() for r in sorted(self.store.regions(), key=lambda r: r.name) if r.kind == kind]
        region = self.store.get(check_region_name(name))  # a name no region can have: 400, as at register
        if region is None:
            raise RegionNotFound(f"Unable to find {kind} shared memory region: '{name}'")
        if region.kind != kind:
            raise RegionNotFound(f"The region named '{name}' is registered as {KINDS[region.kind]}, not {KINDS[kind]}")
        return [region.status()]


def _route(kind: str) -> str:
    return "systemsharedmemory" if kind == SYSTEM else "cudasharedmemory"


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor lives: ``byte_size`` bytes at ``offset`` of region ``region``."""

    region: str
    byte_size: int
    offset: int = 0


def tensor_ref(where: str, params: Mapping[str, Any]) -> TensorRef | None:
    """The shared-memory parameters of an input or output (None: it has none).

    Raises:
        SharedMemoryError: one without ``shared_memory_region`` or ``shared_memory_byte_size``
            (both are required), or a value of the wrong type (Triton's words, then ours).
    """
    if not any(p in params for p in PARAMETERS):
        return None
    region = params.get(REGION)
    if not isinstance(region, str) or not region:
        raise SharedMemoryError(f"Unable to parse 'shared_memory_region'; {where}: parameters.shared_memory_region "
                                f"must name a registered region, got {json.dumps(region)[:40]}")
    values = []
    for key, default in ((BYTE_SIZE, None), (OFFSET, 0)):
        value = params.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SharedMemoryError(f"Unable to parse '{key}'; {where}: parameters.{key} must be a non-negative "
                                    f"integer of bytes{' (required with shared_memory_region)' if default is None else ''}"
                                    f", got {json.dumps(value)[:40]}")
        values.append(value)
    return TensorRef(region, values[0], values[1])


def _unable_to_open(region: Region, path: Path, replaced: bool = False) -> SharedMemoryError:
    """The 400 of a region whose object is not at its key on this node (``replaced``: another
    object is there), in Triton's words, then why."""
    why = (f"was registered over another object than {path} is now: the client removed that object and created a "
           "new one at the key since the register (unregister the region and register it again), or"
           if replaced else f"is registered, but {path} does not exist on the node of the replica that runs this "
           "request: the client removed the object (register it again or send the tensor in the body), or")
    return SharedMemoryError(f"Unable to open shared memory region: '{region.key}'; region '{region.name}' {why} the "
                             "request reached another node than the client's (shared memory works only on the "
                             "server's host)")


def _is_registered_object(region: Region, status: os.stat_result) -> bool:
    """Whether ``status`` is of the object ``region`` was registered over (a registration that
    recorded none, of an older server, takes any regular file)."""
    if region.ino:
        return (status.st_dev, status.st_ino) == (region.dev, region.ino)
    return stat.S_ISREG(status.st_mode)


class _Object:
    """The object a system region was registered over, opened for one read or write of a
    request's tensor (``with _Object(region, path) as obj``) and closed after it. Its bytes are
    read and written with ``pread`` / ``pwrite``, never through a mapping: the client owns the
    object and may shrink, truncate, replace or remove it at any moment, and a page of a mapping
    past the object's end faults (SIGBUS, the process dies) where a ``pread`` just returns fewer
    bytes (answered 400, ``_shrunk``).

    Raises:
        SharedMemoryError: no object at the key, another one than the registered
            (``_unable_to_open``), or not a regular file.
    """

    def __init__(self, region: Region, path: Path) -> None:
        self.region, self.path = region, path
        try:  # O_NONBLOCK: whatever the client put at the key, opening it never waits
            self.fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            raise _unable_to_open(region, path) from None
        status = os.fstat(self.fd)
        self.size = status.st_size  # as it was opened: the client may change it at any time
        if not _is_registered_object(region, status):
            os.close(self.fd)
            raise _unable_to_open(region, path, replaced=True)

    def __enter__(self) -> "_Object":
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def read(self, where: str, ref: TensorRef) -> memoryview:
        """``ref``'s bytes of the region, copied into a new 64-byte aligned buffer (numeric
        inputs decode as aligned views of it).

        Raises:
            SharedMemoryError: the object holds fewer bytes than the region now (``_shrunk``),
                or cannot be read.
        """
        from .binary import aligned_buffer  # binary reads inputs through this module

        view = memoryview(aligned_buffer(ref.byte_size)).cast("B")
        position, done = self.region.offset + ref.offset, 0
        while done < ref.byte_size:
            got = self._io(where, ref, os.preadv, [view[done:]], position + done)
            if got == 0:
                raise self._shrunk(where, ref)
            done += got
        return view

    def write(self, where: str, ref: TensorRef, raw: bytes | memoryview) -> None:
        """``raw`` (at most ``ref.byte_size`` bytes) into ``ref``'s bytes of the region. The
        object's size as it was opened is checked first: one that shrank is refused (``_shrunk``)
        and not grown back; one that shrinks after it was opened grows back to at most the
        registered end (``pwrite`` past the end extends the file; it never faults).

        Raises:
            SharedMemoryError: as ``read``.
        """
        view = memoryview(raw).cast("B")
        position = self.region.offset + ref.offset
        if self.size < position + ref.byte_size:
            raise self._shrunk(where, ref)
        done = 0
        while done < len(view):
            done += self._io(where, ref, os.pwrite, view[done:], position + done)

    def _io(self, where: str, ref: TensorRef, call: Callable[..., Any], *args: Any) -> Any:
        """``call(fd, *args)``, an ``OSError`` answered as the region's 400."""
        try:
            return call(self.fd, *args)
        except OSError as error:
            raise SharedMemoryError(f"Unable to access shared memory region: '{self.region.key}'; {where}: region "
                                    f"'{self.region.name}', offset {ref.offset}, byte size {ref.byte_size}: "
                                    f"{error.strerror or error}") from None

    def _shrunk(self, where: str, ref: TensorRef) -> SharedMemoryError:
        """The 400 of an object that holds fewer bytes than ``ref`` needs (the client shrank it)."""
        start = self.region.offset + ref.offset
        size = self._io(where, ref, os.fstat).st_size
        return SharedMemoryError(
            f"Invalid shared memory region: '{self.region.key}'; {where}: region '{self.region.name}', offset "
            f"{ref.offset}, byte size {ref.byte_size} needs bytes {start} to {start + ref.byte_size} of {self.path}, "
            f"and it holds {size} bytes now (the client shrank it since the region was registered); write the "
            "object back to its size or register the region again")


class SharedMemory:
    """This process's use of the registered regions: ``read_input`` and ``write_outputs`` for an
    infer request (any protocol). A system region's object is opened for each read or write and
    read or written with ``pread`` / ``pwrite`` (``_Object``), never mapped: nothing a client does
    to its object faults this process. A CUDA region's handle is opened once, on first use, and
    closed once the region is unregistered (``forget``, ``sweep``).

    Args:
        store: the registered regions (a request reads their generation when it names one, and
            a region's record only when the generation changed since this process last read
            it, ``RegionCache``: a region registered or unregistered a moment ago, by any router,
            is seen at once).
    """

    def __init__(self, store: RegionStore, cuda: IpcOpenings | None = None) -> None:
        self.store = store
        self.regions = RegionCache(store)
        self.cuda = cuda or IpcOpenings()
        self.registry = Registry(store, self.forget)
        # the last sweep that listed the store: the generation it read, what stayed opened
        self._swept: tuple[Any, set[tuple[bytes, int]]] = (_UNREAD, set())

    def for_request(self) -> "RequestMemory":
        """This process's shared memory for one infer request: the registrations as of its first
        tensor in shared memory (one read of the store's generation then, none for a request
        without such a tensor; ``RegionCache``)."""
        return RequestMemory(self)

    def _region(self, where: str, ref: TensorRef, regions: Lookup | None) -> Region:
        """The region ``ref`` names (from ``regions``; None: the registrations as of now), with
        ``ref`` inside it (Triton's ``GetMemoryInfo`` checks).

        Raises:
            SharedMemoryError: not registered, or an offset and size outside it (Triton's words).
        """
        region = (regions or self.regions.lookup())(ref.region)
        if region is None:
            raise SharedMemoryError(f"Unable to find shared memory region: '{ref.region}'; {where} names it, and it "
                                    "is not registered (POST /v2/systemsharedmemory/region/{name}/register)")
        if ref.offset >= region.byte_size:
            raise SharedMemoryError(f"Invalid offset for shared memory region: '{ref.region}'; {where}: offset "
                                    f"{ref.offset}, the region holds {region.byte_size} bytes")
        if ref.offset + ref.byte_size > region.byte_size:
            raise SharedMemoryError(f"Invalid offset + byte size for shared memory region: '{ref.region}'; {where}: "
                                    f"offset {ref.offset} + byte size {ref.byte_size} = {ref.offset + ref.byte_size} "
                                    f"bytes, the region holds {region.byte_size}")
        return region

    def _object(self, region: Region) -> _Object:
        """The object system region ``region`` was registered over, opened (``_Object``).

        Raises:
            SharedMemoryError: as ``_Object``.
        """
        return _Object(region, key_path(region.name, region.key))

    def _lease(self, region: Region, device_id: int) -> ContextManager[int]:
        """CUDA region ``region``'s base address on ``device_id`` (``IpcOpenings.lease``)."""
        return self.cuda.lease(base64.b64decode(region.raw_handle), device_id, region.name)

    def read_input(self, where: str, datatype: str, shape: tuple[int, ...],
                   params: Mapping[str, Any], regions: Lookup | None = None) -> np.ndarray | DeviceTensor:
        """Input ``where`` (``datatype``, ``shape``) from the region its ``params`` name: a copy of
        the region's bytes for a numeric datatype (``_Object.read``), decoded for BYTES (4-byte length
        then bytes, per element); from a CUDA region, a ``DeviceTensor`` (the model's backend
        opens it and binds it where it runs on the GPU; anywhere else it is refused, 400).
        ``regions``: the registrations the request uses (``for_request``; None: as of now).

        Raises:
            SharedMemoryError: as ``tensor_ref`` and ``_region``; the object is gone from this
                node, replaced or shrunk (``_Object``); ``shared_memory_byte_size`` is not shape
                x datatype (Triton's words).
            InvalidInput: the bytes are not a valid tensor (BOOL bytes other than 0 and 1,
                BYTES lengths that overrun).
        """
        from .binary import tensor_from_bytes  # binary reads inputs through this class

        from .binary import fixed_byte_size

        ref = tensor_ref(where, params)
        assert ref is not None  # the caller dispatched on shared_memory_region
        region = self._region(where, ref, regions)
        if region.kind == CUDA:
            if datatype == "BYTES":
                raise SharedMemoryError(f"{where}: BYTES tensors cannot be read from CUDA shared memory region "
                                        f"'{region.name}' (their lengths would be read on the host); put them "
                                        "in system shared memory or in the request body")
            fixed_byte_size(where, datatype, shape, ref.byte_size, "shared_memory_byte_size")
            return DeviceTensor(tuple(shape), NUMPY_BY_DATATYPE[datatype], region.name, ref.offset,
                                functools.partial(self._lease, region), where)
        with self._object(region) as obj:
            raw = obj.read(where, ref)
        return tensor_from_bytes(where, raw, datatype, shape, "shared_memory_byte_size")

    def device_outputs(self, request: InferRequest, regions: Lookup | None = None) -> InferRequest:
        """``request`` with each requested output whose parameters name a CUDA region as a
        ``DeviceOutput`` (the backend that runs the model on the GPU writes it there);
        ``regions`` as ``read_input``'s.

        Raises:
            SharedMemoryError: as ``tensor_ref`` and ``_region``.
        """
        if not request.outputs:
            return request
        names: list[str] = []
        for name in request.outputs:
            ref = tensor_ref(f"output '{name}'", request.output_parameters.get(name) or {})
            region = None if ref is None else self._region(f"output '{name}'", ref, regions)
            if ref is None or region is None or region.kind != CUDA:
                names.append(name)
                continue
            names.append(DeviceOutput(name, region.name, ref.byte_size, ref.offset,
                                      functools.partial(self._lease, region)))
        return dataclasses.replace(request, outputs=names)

    def write_outputs(self, request_params: Mapping[str, Mapping[str, Any]], outputs: Mapping[str, np.ndarray],
                      regions: Lookup | None = None) -> dict[str, dict[str, Any]]:
        """Write each output whose parameters (``request_params``: output name -> its request
        parameters) name a region into it (row-major, little-endian; BYTES as 4-byte length then
        bytes per element); ``regions`` as ``read_input``'s. Returns, per output written, the
        parameters its answer echoes.

        Raises:
            SharedMemoryError: as ``tensor_ref`` and ``_region``; the output is larger than
                ``shared_memory_byte_size`` (Triton's words); the object is gone, replaced or
                shrunk (``_Object``).
        """
        from .binary import raw_bytes

        written: dict[str, dict[str, Any]] = {}
        for name, array in outputs.items():
            params = request_params.get(name)
            if not params:  # an output answered in the body
                continue
            where = f"output '{name}'"
            ref = tensor_ref(where, params)
            if ref is None:
                continue
            region = self._region(where, ref, regions)
            if region.kind == CUDA or isinstance(array, DeviceTensor):
                if not isinstance(array, DeviceTensor) or array.region != region.name:  # not written on the GPU
                    raise not_on_gpu(where, ref.region, "this output was computed on the host")
            else:
                raw = raw_bytes(array)
                size = len(raw)
                if size > ref.byte_size:
                    raise output_too_small(name, ref.byte_size, size, datatype_of(array), array.shape)
                with self._object(region) as obj:
                    obj.write(where, ref, raw)
            written[name] = {k: params[k] for k in PARAMETERS if k in params}
        return written

    def forget(self, region: Region) -> None:
        """Close ``region``'s CUDA handle here (it was unregistered): at once, or once the
        requests that still use it let go (``IpcOpenings.close``). A system region holds nothing
        open between requests."""
        if region.kind == CUDA:
            self.cuda.close(base64.b64decode(region.raw_handle))

    def sweep(self) -> int:
        """Close every CUDA handle that no registered region names any more (unregistered through
        another router), as ``forget``; returns how many stay opened. Reads the store only when
        something is opened, and lists its regions only when the store's generation changed
        since the last sweep, or something was opened that it did not see (all it saw were
        registered as of that generation, and nothing was removed since). Only what was opened
        before the store was read is closed: a region registered and first used while it is
        read is not in what it read, and stays."""
        if not self.cuda.opened:
            return 0
        opened_before = self.cuda.keys()
        generation = self.store.generation()
        swept_generation, swept_opened = self._swept
        if generation == swept_generation and opened_before <= swept_opened:
            return len(opened_before)
        handles = {base64.b64decode(r.raw_handle) for r in self.store.regions() if r.kind == CUDA}
        opened = self.cuda.keep_only(handles, among=opened_before)
        self._swept = (generation, {k for k in opened_before if k[0] in handles})
        return opened

    def close(self) -> None:
        """Close every CUDA handle (the process stops serving)."""
        self.cuda.close_all()


class RequestMemory:
    """One infer request's use of ``shm`` (``SharedMemory.for_request``): ``read_input``,
    ``device_outputs`` and ``write_outputs`` as ``SharedMemory``'s, every region the request
    names read from the registrations as of the first one it names (``RegionCache.lookup``)."""

    def __init__(self, shm: SharedMemory) -> None:
        self.shm = shm
        self._regions: Lookup | None = None

    def _named(self, name: str) -> Region | None:
        if self._regions is None:
            self._regions = self.shm.regions.lookup()
        return self._regions(name)

    def read_input(self, where: str, datatype: str, shape: tuple[int, ...],
                   params: Mapping[str, Any]) -> np.ndarray | DeviceTensor:
        return self.shm.read_input(where, datatype, shape, params, self._named)

    def device_outputs(self, request: InferRequest) -> InferRequest:
        return self.shm.device_outputs(request, self._named)

    def write_outputs(self, request_params: Mapping[str, Mapping[str, Any]],
                      outputs: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
        return self.shm.write_outputs(request_params, outputs, self._named)
