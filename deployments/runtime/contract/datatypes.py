"""KServe v2 / Open Inference Protocol datatypes and their numpy and ONNX equivalents.

Source: the Open Inference Protocol REST spec, "Tensor Data Types" table.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from .errors import InvalidInput

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]

NUMPY_BY_DATATYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

# ONNX Runtime's type strings (NodeArg.type) for each datatype.
ONNX_TYPE_BY_DATATYPE: dict[str, str] = {
    "BOOL": "tensor(bool)",
    "UINT8": "tensor(uint8)",
    "UINT16": "tensor(uint16)",
    "UINT32": "tensor(uint32)",
    "UINT64": "tensor(uint64)",
    "INT8": "tensor(int8)",
    "INT16": "tensor(int16)",
    "INT32": "tensor(int32)",
    "INT64": "tensor(int64)",
    "FP16": "tensor(float16)",
    "FP32": "tensor(float)",
    "FP64": "tensor(double)",
    "BYTES": "tensor(string)",
}

# Triton's DataType enum names (model_config.proto) by KServe v2 datatype (BYTES is Triton's
# TYPE_STRING): a config.pbtxt's ``data_type`` and the model configuration route's.
TRITON_TYPES: dict[str, str] = {name: "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}"
                                for name in NUMPY_BY_DATATYPE}


_DATATYPE_BY_DTYPE: dict[np.dtype, str] = {np.dtype(t): name for name, t in NUMPY_BY_DATATYPE.items()
                                           if np.dtype(t).kind not in "OSU"}


def datatype_of(array: np.ndarray) -> str:
    """KServe datatype of a numpy array; object and string arrays are BYTES.

    Raises:
        KeyError: the dtype has no KServe v2 equivalent.
    """
    found = _DATATYPE_BY_DTYPE.get(array.dtype)  # per output of every answer: a lookup, not a scan
    if found is not None:
        return found
    if array.dtype.kind in "OSU":
        return "BYTES"
    for name, dtype in NUMPY_BY_DATATYPE.items():
        if dtype == array.dtype:
            return name
    raise KeyError(f"numpy dtype {array.dtype} has no KServe v2 datatype")


def zeros(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array of ``shape`` holding zero of ``datatype``: numeric zeros, or for BYTES the text
    ``b"0"`` in every element (an object array), which a model parsing numbers from strings accepts."""
    if datatype == "BYTES":
        return np.full(shape, b"0", dtype=object)
    return np.zeros(shape, dtype=NUMPY_BY_DATATYPE[datatype])


def check_integer_range(where: str, datatype: str, values: Sequence[int] | np.ndarray) -> None:
    """Check that integer ``values`` (Python ints of any size, or an integer array) fit the
    integer ``datatype`` (UINT8 ... INT64).

    Raises:
        InvalidInput: naming the first value out of the datatype's range, and the range.
    """
    info = np.iinfo(NUMPY_BY_DATATYPE[datatype])
    if len(values) == 0:
        return
    if isinstance(values, np.ndarray):
        if values.min() >= info.min and values.max() <= info.max:
            return
        index = int(np.flatnonzero((values < info.min) | (values > info.max))[0])
    else:
        if min(values) >= info.min and max(values) <= info.max:
            return
        index = next(i for i, v in enumerate(values) if not info.min <= v <= info.max)
    raise InvalidInput(f"{where}: {datatype} data element {index} is {int(values[index])}, out of {datatype}'s "
                       f"range [{info.min}, {info.max}]")
