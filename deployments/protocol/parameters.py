"""The ``parameters`` of an infer request, its inputs and its outputs: what this server does with
each one that Triton's HTTP/REST protocol and its extensions define, and Triton's classification
extension.

Sources: Triton Inference Server, docs/protocol/extension_binary_data.md (``binary_data``,
``binary_data_size``, ``binary_data_output``), extension_classification.md (``classification``),
extension_shared_memory.md (``shared_memory_region``, ``shared_memory_byte_size``,
``shared_memory_offset``), extension_sequence.md (``sequence_id``, ``sequence_start``,
``sequence_end``), extension_schedule_policy.md (``priority``, ``timeout``); MLServer's
``content_type``.

A parameter that would change the answer and that this server does not implement (sequences) is
refused with 400 naming it, never ignored; so is a parameter no one defines (it
can only be a mistake or a feature this server lacks). ``priority`` is accepted and has no
effect: requests are served in arrival order, which changes no answer. ``timeout`` (microseconds)
shortens the router's wait for the model (``InferRequest.timeout_s``). The shared-memory
parameters are read where the tensors are (``protocol.binary``, ``protocol.shared_memory``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

import numpy as np

from ..runtime.contract.datatypes import datatype_of
from ..runtime.contract.errors import InvalidInput, SharedMemoryError

REQUEST_PARAMETERS = ("binary_data_output", "priority", "timeout")
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
INPUT_PARAMETERS = ("binary_data_size", "content_type", *SHARED_MEMORY_PARAMETERS)
OUTPUT_PARAMETERS = ("binary_data", "classification", *SHARED_MEMORY_PARAMETERS)

_NOT_IMPLEMENTED = {
    "sequence_id": "the sequence extension is not supported: models here are stateless",
    "sequence_start": "the sequence extension is not supported: models here are stateless",
    "sequence_end": "the sequence extension is not supported: models here are stateless",
}


def check_parameters(where: str, params: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    """Raises InvalidInput naming the first parameter in ``params`` not in ``allowed``.

    Args:
        where: ``request``, ``input 'x'`` or ``output 'y'`` for the message.
        params: the object's ``parameters``.
        allowed: the keys this object may carry (``REQUEST_PARAMETERS`` ...).
    """
    for key in params:
        if key in allowed:
            continue
        reason = _NOT_IMPLEMENTED.get(key, "not a parameter this server knows")
        raise InvalidInput(f"{where}: parameters.{json.dumps(key)[:60]}: {reason}; allowed here: {list(allowed)}")


def check_shared_memory_output(where: str, params: Mapping[str, Any]) -> None:
    """An output in shared memory asks for neither ``classification`` nor ``binary_data``: true
    (Triton's words, ``ValidateOutputParameter``).

    Raises:
        SharedMemoryError: it does.
    """
    if "shared_memory_region" not in params:
        return
    if "classification" in params:
        raise SharedMemoryError(f"Output can't set both 'shared_memory_region' and 'classification'; {where}")
    if params.get("binary_data") is True:
        raise SharedMemoryError(f"Output can't set both 'shared_memory_region' and 'binary_data'; {where}")


UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1


def _int_in(value: Any, requirement: str, least: int = 1, most: int = UINT64_MAX) -> int | None:
    """``value`` when it is an integer in [``least``, ``most``] (booleans are not), None when absent.

    Raises:
        InvalidInput: ``requirement``, the allowed range, then the value received.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidInput(f"{requirement} in [{least}, {most}], got {json.dumps(value)[:40]}")
    return value


def timeout_s(params: Mapping[str, Any]) -> float | None:
    """The request's ``timeout`` parameter (microseconds, Triton's unit, a uint64 there) in
    seconds, or None.

    Raises:
        InvalidInput: not an integer in [1, 2**64 - 1].
    """
    value = _int_in(params.get("timeout"), "request: parameters.timeout must be an integer of microseconds")
    return None if value is None else value / 1e6


def check_priority(params: Mapping[str, Any]) -> None:
    """The request's ``priority`` parameter must be absent or an integer in [0, 2**64 - 1]
    (Triton's priority level, a uint64; 0 is the model's default). Accepted and not acted on:
    every request here has the same priority.

    Raises:
        InvalidInput: another value.
    """
    _int_in(params.get("priority"), "request: parameters.priority must be a priority level (an integer; 0 is the "
            "model's default)", least=0)


def class_count(where: str, params: Mapping[str, Any]) -> int | None:
    """The output's ``classification`` parameter (top-k), or None. Triton's class count is a
    uint32; a count above the output's size gives every class (``classify``), as Triton does.

    Raises:
        InvalidInput: not an integer in [1, 2**32 - 1].
    """
    return _int_in(params.get("classification"),
                   f"{where}: parameters.classification (class_count) must be an integer", most=UINT32_MAX)


def check_flag(where: str, params: Mapping[str, Any], key: str) -> bool | None:
    """The boolean parameter ``key`` (``binary_data``, ``binary_data_output``), or None.

    Raises:
        InvalidInput: present and not true/false; names the parameter and its type.
    """
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{where}: parameters.{key} must be true or false (a bool), got "
                           f"{type(value).__name__} {json.dumps(value)[:40]}")
    return value


def classify(where: str, array: np.ndarray, k: int, batched: bool) -> np.ndarray:
    """Triton's classification extension: the top ``k`` classes of a numeric output.

    Args:
        where: ``model 'm' output 'o'`` for messages.
        array: the output, ``(N, ...)`` when ``batched`` (one ranking per row over the rest,
            flattened), else any shape (one ranking over all of it).
        k: classes wanted; more than there are gives them all (as Triton does).
        batched: the model has a batch axis (``max_batch_size > 0``).

    Returns:
        BYTES (object array of bytes) ``(N, k)`` when batched, else ``(k,)``; each element
        ``b"<value>:<index>"``, value as C's ``%f`` (Triton's ``std::to_string``), highest first,
        ties by lower index.

    Raises:
        InvalidInput: the output is not numeric (BYTES or BOOL).
    """
    if array.dtype.kind not in "iuf":
        raise InvalidInput(f"{where}: classification needs a numeric output, this one is "
                           f"{datatype_of(array)}")
    per_batch = batched and array.ndim > 0
    # the row length spelled out: ``-1`` cannot be solved for an output with no rows (shape [0, ...])
    rows = array.reshape((array.shape[0], math.prod(array.shape[1:])) if per_batch else (1, array.size))
    k = min(k, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty(order.shape, dtype=object)
    for r, row in enumerate(order):
        for j, index in enumerate(row):
            out[r, j] = f"{float(rows[r, index]):f}:{int(index)}".encode()
    return out if batched else out.reshape(k)


def apply_classification(model_name: str, batched: bool, output_parameters: Mapping[str, Mapping[str, Any]],
                         outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``outputs`` with every output that asked for ``classification`` replaced by its top-k.

    Raises:
        InvalidInput: a bad ``classification`` value, or a non-numeric output.
    """
    result = dict(outputs)
    for name, params in output_parameters.items():
        k = class_count(f"output '{name}'", params)
        if k is not None and name in result:
            result[name] = classify(f"model '{model_name}' output '{name}'", result[name], k, batched)
    return result
