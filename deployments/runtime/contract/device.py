"""Tensors that live in GPU memory the request brought (a CUDA shared-memory region): inputs
used where they are and outputs written where they go, with no host copy.

``DeviceTensor`` stands where a request's input array stands: validation reads its ``shape``,
``dtype`` and ``ndim`` as an array's; a backend that runs on the GPU binds its address
(``lease``) as the input. ``DeviceOutput`` is a requested output's name (a ``str``, so every
layer that passes output names passes it unchanged) that also says where the output goes; the
backend writes the output there and answers a ``DeviceTensor`` describing what it wrote.

A backend takes them when its engine says ``device_io = True`` (``takes_device_io``); anywhere
else (the CPU provider, the router, a pipeline's own process) ``refuse_device_io`` answers 400
naming why (``not_on_gpu``).

Source of the error words: Triton Inference Server, src/shared_memory_manager.cc and
src/infer_response.cc (the output size check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Mapping

import numpy as np

from .errors import SharedMemoryError

# ``lease(device_id)``: while entered, the region's base address on CUDA device ``device_id`` (the
# one the model runs on, as this process numbers devices); its memory stays open until exit.
Lease = Callable[[int], ContextManager[int]]


@dataclass(frozen=True, eq=False)
class DeviceTensor:
    """``shape`` x ``dtype`` at ``offset`` bytes into CUDA shared-memory region ``region``
    (``lease`` gives its base address), named ``where`` in messages (``input 'x'``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    region: str
    offset: int
    lease: Lease
    where: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class DeviceOutput(str):
    """A requested output's name that also says where the output goes: ``byte_size`` bytes at
    ``offset`` of CUDA shared-memory region ``region`` (``lease`` gives its base address)."""

    region: str
    byte_size: int
    offset: int
    lease: Lease

    def __new__(cls, name: str, region: str, byte_size: int, offset: int, lease: Lease) -> "DeviceOutput":
        out = super().__new__(cls, name)
        out.region, out.byte_size, out.offset, out.lease = region, byte_size, offset, lease
        return out

    def written(self, shape: tuple[int, ...], dtype: np.dtype) -> DeviceTensor:
        """What an output of ``shape`` x ``dtype`` written here is (the answer lists it)."""
        return DeviceTensor(tuple(shape), np.dtype(dtype), self.region, self.offset, self.lease, f"output '{self}'")

    def check_fits(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        """The bytes an output of ``shape`` x ``dtype`` takes, when ``byte_size`` holds them.

        Raises:
            SharedMemoryError: it does not fit (``output_too_small``).
        """
        size = math.prod(shape) * np.dtype(dtype).itemsize
        if size > self.byte_size:
            raise output_too_small(str(self), self.byte_size, size, datatype_name(dtype), shape)
        return size


def datatype_name(dtype: np.dtype) -> str:
    from .datatypes import datatype_of

    return datatype_of(np.empty(0, dtype))


def output_too_small(name: str, byte_size: int, size: int, datatype: str, shape: Iterable[int]) -> SharedMemoryError:
    """The 400 of an output of ``size`` bytes (``datatype`` ``shape``) asked into ``byte_size``
    bytes of shared memory (Triton's words, then the output's type)."""
    return SharedMemoryError(
        f"shared memory size specified with the request for output '{name}' ({byte_size} bytes) should be at "
        f"least {size} bytes to hold the results; it is {datatype} {list(shape)}")


def not_on_gpu(where: str, region: str, why: str) -> SharedMemoryError:
    """The 400 of a CUDA shared-memory tensor (``where``: ``input 'x'``, in ``region``) that
    reached a process that does not run the model on a GPU; ``why`` says what runs here."""
    return SharedMemoryError(
        f"{where}: shared memory region '{region}' is CUDA shared memory, and this server reads and writes CUDA "
        f"shared memory only in a replica that runs the model on a GPU; {why}: put the tensor in system shared "
        "memory (/v2/systemsharedmemory) or in the request body")


def device_io(inputs: Mapping[str, Any], outputs: Iterable[str] | None) -> list[DeviceTensor | DeviceOutput]:
    """The inputs and requested outputs of a request that live in GPU memory."""
    found: list[DeviceTensor | DeviceOutput] = [v for v in inputs.values() if isinstance(v, DeviceTensor)]
    return found + [n for n in outputs or () if isinstance(n, DeviceOutput)]


def refuse_device_io(inputs: Mapping[str, Any], outputs: Iterable[str] | None, why: str) -> None:
    """Raise ``not_on_gpu`` (400) for the first input or output in GPU memory, if any.

    Raises:
        SharedMemoryError: one of them lives in a CUDA shared-memory region.
    """
    for item in device_io(inputs, outputs):
        where = item.where if isinstance(item, DeviceTensor) else f"output '{item}'"
        raise not_on_gpu(where, item.region, why)


def takes_device_io(engine: Any) -> bool:
    """Whether ``engine``'s contexts take ``DeviceTensor`` inputs and ``DeviceOutput`` targets
    (``infer(inputs, targets)``): its ``device_io`` attribute."""
    return bool(getattr(engine, "device_io", False))


def device_targets(outputs: Iterable[str] | None) -> dict[str, DeviceOutput]:
    """The requested outputs that go to GPU memory, by name."""
    return {str(n): n for n in outputs or () if isinstance(n, DeviceOutput)}
