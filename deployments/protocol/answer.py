"""One infer request from its body to its answer: decode, run, apply ``classification``, encode.

The router runs it for a dedicated model (``routes.V2Routes``, in the model's own replica on
the one-hop path); for a pool model the router passes the body through as bytes and the pool
replica runs it (``pool.PoolDeployment.infer_body``), so the tensors are decoded once, where the
model runs, and the router only routes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import numpy as np

from ..runtime.contract.errors import InferenceTimeout
from ..runtime.contract.outputs import parameters_of
from .binary import decode_body, encode_response
from .parameters import apply_classification
from .shared_memory import SharedMemory
from .v2 import InferRequest

T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    """An infer response: ``content`` (bytes) and ``headers``, and the seconds spent decoding
    the request (``compute_input_s``) and encoding the answer (``compute_output_s``)."""

    content: bytes
    headers: dict[str, str]
    compute_input_s: float
    compute_output_s: float


async def answer(model: str, version: str, batched: bool, chunks: list[bytes], header_length: str | None,
                 run: Callable[[InferRequest], Awaitable[dict[str, np.ndarray]]],
                 shm: SharedMemory | None = None) -> Answer:
    """Decode ``chunks`` (with the ``Inference-Header-Content-Length`` value ``header_length``),
    ``run`` the decoded request (its outputs by name), and encode the answer for model
    ``model`` at ``version``; ``batched``: the model's first dimension is the batch
    (``max_batch_size > 0``), for ``classification``. Inputs and outputs in shared memory are
    read and written through ``shm`` (this process's; None: refused), every region named by the
    registrations as of the first (``SharedMemory.for_request``); those in CUDA shared
    memory reach ``run`` as ``DeviceTensor`` inputs and ``DeviceOutput`` names
    (``runtime.contract.device``), which only a backend on the GPU takes.

    Raises:
        InvalidInput: a malformed body or classification parameter (400).
        SharedMemoryError: as ``SharedMemory.read_input`` and ``write_outputs`` (400).
        Exception: what ``run`` raises.
    """
    start = time.perf_counter()
    memory = None if shm is None else shm.for_request()
    request = decode_body(chunks, header_length, memory)
    if memory is not None:
        request = memory.device_outputs(request)
    decoded = time.perf_counter()
    outputs = await run(request)
    ran = time.perf_counter()
    parameters = parameters_of(outputs)  # the answer's own response parameters, if any
    outputs = apply_classification(model, batched, request.output_parameters, outputs)
    content, headers = encode_response(model, version, request, outputs, parameters, memory)
    return Answer(content, headers, decoded - start, time.perf_counter() - ran)


async def answer_body(model: str, version: str, batched: bool, chunks: list[bytes], header_length: str | None,
                      infer: Callable[[dict[str, np.ndarray], list[str] | None], Awaitable[dict[str, np.ndarray]]],
                      default_timeout_s: float, shm: SharedMemory | None = None) -> Answer:
    """``answer`` where the model runs: ``infer(inputs, outputs)`` within the request's own
    ``parameters.timeout`` where shorter than ``default_timeout_s``, else within
    ``default_timeout_s`` (``within_timeout``); ``shm`` as ``answer``'s."""
    async def run(request: InferRequest) -> dict[str, np.ndarray]:
        return await within_timeout(model, infer(request.inputs, request.outputs), request.timeout_s,
                                    default_timeout_s)

    return await answer(model, version, batched, chunks, header_length, run, shm)


def request_bound(timeout_s: float | None, default_s: float) -> tuple[float, bool]:
    """The seconds a model call may take: the request's ``parameters.timeout`` (``timeout_s``)
    where it is shorter than ``default_s`` (the application's ``request_timeout_s``), else
    ``default_s``; and whether the request's own was taken."""
    asked = timeout_s is not None and timeout_s < default_s
    return (timeout_s if asked else default_s), asked


def timeout_error(model: str, timeout_s: float, asked: bool) -> InferenceTimeout:
    """The 504 of a model call that took longer than ``timeout_s``: the request's own
    ``parameters.timeout`` (``asked``) or the application's ``request_timeout_s``."""
    limit = f"{timeout_s:g} s" if timeout_s >= 1 else f"{timeout_s * 1e3:g} ms"
    return InferenceTimeout(f"model '{model}' did not answer within {limit}" + (
        f" (the request's parameters.timeout: {round(timeout_s * 1e6)} microseconds)" if asked else
        " (request_timeout_s of the application args)"))


async def within_timeout(model: str, call: Awaitable[dict[str, np.ndarray]], timeout_s: float | None,
                         default_s: float) -> dict[str, np.ndarray]:
    """``call`` to model ``model``, bounded by the request's ``parameters.timeout``
    (``timeout_s``) where it is shorter than ``default_s`` (the application's
    ``request_timeout_s``), else by ``default_s``.

    Raises:
        InferenceTimeout: the bound passed (the message names which).
    """
    timeout_s, asked = request_bound(timeout_s, default_s)
    answered, result = await answered_within(call, timeout_s)
    if answered:
        return result
    raise timeout_error(model, timeout_s, asked)


async def answered_within(call: Awaitable[T], seconds: float) -> tuple[bool, T | None]:
    """``(True, call's result)`` where ``call`` answered within ``seconds``, ``(False, None)``
    where it did not: the bound fired, or the answer came past it without the bound firing
    (``late``). Bounded in this task: no task per call, as ``wait_for``'s."""
    try:
        async with asyncio.timeout(seconds) as bound:
            result = await call
        if not late(bound):
            return True, result
    except TimeoutError:
        pass
    return False, None


def late(bound: asyncio.Timeout) -> bool:
    """Whether an answer came past ``bound`` without the bound firing: a call that never yielded
    to the event loop (a model run in the loop's thread, ``ModelHost.runs_inline``) is as late as
    one answered from a worker thread after its deadline, and answers 504 alike. The clock is
    read now: uvloop's ``loop.time()`` (Serve's replicas run on uvloop) is the time its current
    iteration began, which a run that never yielded does not move; both loops count
    ``CLOCK_MONOTONIC``, as ``time.monotonic()``."""
    when = bound.when()
    return when is not None and max(asyncio.get_running_loop().time(), time.monotonic()) >= when
