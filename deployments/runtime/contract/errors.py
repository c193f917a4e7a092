"""Typed serving errors: the only exceptions the engine layer raises on purpose.

Each class maps to one HTTP status in ``deployments.protocol.errors.STATUS_BY_ERROR``
(the one error table). A ``ServingError``'s message is written for the client: it names
what was wrong and what is allowed, and never carries internal exception text.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base class; ``message`` is safe to send to a client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # keeps the type and message across Ray's pickling
        return (type(self), (self.message,))


class InvalidInput(ServingError):
    """The request is malformed or does not fit the model's contract (HTTP 400)."""


class InvalidParameter(InvalidInput):
    """A named field of the request is invalid (HTTP 400, as ``InvalidInput``); ``param`` names
    it, for protocols whose error body says which (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return (type(self), (self.message, self.param))


class SharedMemoryError(InvalidInput):
    """A request's use of a shared-memory region (Triton's system and CUDA shared-memory
    extensions) is invalid: an unregistered region, an offset or size outside it, a key that is
    not in this node's ``/dev/shm``, a byte size that does not fit the tensor, a CUDA region
    where the model runs on the CPU; or a registration that cannot be made (HTTP 400, as
    Triton answers them)."""


class RegionNotFound(ServingError):
    """The status of a shared-memory region that is not registered (HTTP 404, Triton's
    NOT_FOUND)."""


class ModelNotFound(ServingError):
    """Unknown model or version (HTTP 404)."""


class MethodNotAllowed(ServingError):
    """The route exists but not for this HTTP method (HTTP 405)."""


class RequestTimeout(ServingError):
    """The request did not arrive in time: its body stalled (HTTP 408)."""


class PayloadTooLarge(ServingError):
    """The request is over a configured limit: its body's bytes, or what a model accepts in one
    request (a pipeline's texts per request, tokens per text) (HTTP 413)."""


class UnsupportedMediaType(ServingError):
    """The request body uses an encoding the server cannot decode, e.g. ``Content-Encoding: br``
    (HTTP 415)."""


class ModelNotReady(ServingError):
    """The model exists but is not loaded or still loading (HTTP 503)."""


class StoreUnavailable(ModelNotReady):
    """The model store (an object store holding the repository) did not answer within its
    bounded tries, or refused access: a load or a read of the repository fails, the models
    already loaded keep serving (HTTP 503). The message names the model and the store's URL
    and endpoint, never credentials nor the store's own error text."""


class OverBudget(ServingError):
    """Loading the model would exceed the memory budget (HTTP 503)."""


class DeviceOutOfMemory(OverBudget):
    """The device ran out of memory while a model was loaded or warmed (an allocation the
    runtime refused, over a memory cap such as ``gpu_mem_limit_mib``): capacity, not a fault of
    the request that asked for the load (HTTP 503, as ``OverBudget``)."""


class Overloaded(ServingError):
    """The model's bounded queue is full: the request is shed at once, before any work (HTTP 503
    with a ``Retry-After`` header of ``retry_after_s`` seconds)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (type(self), (self.message, self.retry_after_s))


class MisdirectedRequest(ServingError):
    """The request reached a replica of another server (another Ray cluster on the same host,
    through a port that cluster's replica holds now): it was not run here (HTTP 421)."""


class InferenceTimeout(ServingError):
    """No execution context or answer within the deadline (HTTP 504)."""


class InferenceError(ServingError):
    """A real fault while running a model (HTTP 500); the message names the failed call."""


class EngineFault(InferenceError):
    """A fault of the engine or device that no request causes (a profile switch TensorRT
    refuses, a sticky CUDA error); retrying requests one by one cannot help (HTTP 500)."""


class ConfigError(ServingError):
    """A config someone wrote is invalid (a model's ``config.yaml``, the application's args, a
    config that disagrees with its model file); names the file and field.

    At start it stops the start. A load through the repository API answers it 400 (whoever asks
    for a load points at the repository: ``deployments.control.outcome``). On a request's own
    path (a lazy load) it is the server's configuration at fault: 500.
    """


class InvalidModelFile(ConfigError):
    """A model file in the repository is not one the server can serve: it does not parse as an
    ONNX model (random bytes, empty, truncated), it uses an operator ONNX Runtime does not
    implement (a custom domain's), its graph has no inputs or outputs. The file is the content
    of whoever put it in the repository, as a config is: 400 on every path (a load, a lazy load
    at a request, and at start it stops the start as any ``ConfigError``). The message names the
    model, its file relative to the repository (``<model>/<version>/model.onnx``) and what is
    wrong; never a ``config.yaml`` that does not exist."""


class LoadFault(ServingError):
    """The server could not bring a model up through no fault of whoever asked for it (HTTP
    500): its model file cannot be read, no TensorRT plan fits this machine, the device's
    runtime did not start, a warm-up run failed. Not a ``ConfigError``: a load that meets it
    answers 500, not 400. The message names the model and what failed; the cause's own text
    is in the server log."""


def refused_by_the_model(error: BaseException) -> bool:
    """Whether a run of the server's own making (a config's warm-up, a warming or measuring run
    on zeros) failed because the model refused its input (``InvalidInput``, an
    ``InferenceError``), not because the engine or device is unusable (``EngineFault``)."""
    return isinstance(error, (InferenceError, InvalidInput)) and not isinstance(error, EngineFault)


def unknown_model(name: str, detail: str, version: str | None = None) -> ModelNotFound:
    """``ModelNotFound`` worded as Triton words it, our detail after it:
    ``Request for unknown model: 'name' [version V ]is not found; <detail>``.

    Triton's example clients check ``message().startswith("Request for unknown model")``
    (source: Triton core, ``ModelRepositoryManager::GetModel`` / ``FindModelIdentifier``).
    """
    what = f"'{name}'" if version is None else f"'{name}' version {version}"
    return ModelNotFound(f"Request for unknown model: {what} is not found; {detail}")


def unloaded_model(name: str, reason: str | None = None) -> ModelNotReady:
    """``ModelNotReady`` for a model unloaded through the repository API (or whose load failed:
    ``reason`` says why), in Triton's words (``ModelLifeCycle::GetModel``: a known model with no
    version loaded), our detail after."""
    if reason is not None:
        return ModelNotReady(f"Request for unknown model: '{name}' has no available versions; it is not loaded: "
                             f"{reason}; POST /v2/repository/models/{name}/load tries again")
    return ModelNotReady(f"Request for unknown model: '{name}' has no available versions; it is unloaded: "
                         f"POST /v2/repository/models/{name}/load loads it")


def replaced_version(name: str, asked: int, served: str) -> ModelNotReady:
    """``ModelNotReady`` for a request labelled with version ``asked`` of model ``name`` that
    reaches a replica where a load replaced that version (``served``: what serves now, e.g.
    "version 2"); never run on another version's engine."""
    return ModelNotReady(f"model '{name}' version {asked} is no longer served by this replica: a load replaced "
                         f"it with {served}; send the request again")


def unreadable_model_file(name: str, reader: str, error: BaseException, file: str = "") -> ServingError:
    """The error for a model file that ``reader`` (``"ONNX Runtime"``, ``"onnx"``) could not read.

    A missing file (``OSError``) is the server's (``LoadFault``, 500: its repository changed
    under it); any other failure is the file's content (``InvalidModelFile``, 400: damaged,
    truncated or not ONNX). The message names the model, its file (``file``, relative to the
    repository) and the error's type only: the reader's own text names the file's full path,
    which is for the server log, never for a client.
    """
    if isinstance(error, OSError) and not isinstance(error, UnicodeError):
        return LoadFault(f"model '{name}': {reader} could not read its model file {file} ({type(error).__name__}): "
                         "the file is missing or unreadable; the server log has the details")
    return InvalidModelFile(f"model '{name}': its model file {file} is not a valid ONNX model: {reader} could not "
                            f"parse it ({type(error).__name__}; damaged, truncated or another format); the server "
                            "log has the details")


def unsupported_operator(name: str, file: str, op: str, domain: str) -> InvalidModelFile:
    """``InvalidModelFile`` for a model file using operator ``op`` of ``domain`` that ONNX Runtime
    does not implement."""
    return InvalidModelFile(f"model '{name}': its model file {file} uses operator '{op}' of domain "
                            f"'{domain or 'ai.onnx'}', which ONNX Runtime does not implement (custom operators "
                            "and domains are not supported); export the model with standard ONNX operators")
