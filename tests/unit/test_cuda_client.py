"""``tests/gpu/cuda_client.py``'s ``CudaClient`` without a GPU: its worker runs this module's fake
of tritonclient's ``cuda_shared_memory`` (a region is a file of its size under
``FAKE_CUDA_REGIONS_DIR``; its "raw handle" is the file's path in base64), so what the worker
made, wrote and freed is seen from here."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import numpy as np
import pytest

from tests.gpu.cuda_client import CudaClient

FAKE_DIR = "FAKE_CUDA_REGIONS_DIR"


def create_shared_memory_region(name, byte_size, device_id):
    path = Path(os.environ[FAKE_DIR]) / f"{name}-on-{device_id}"
    with path.open("xb") as f:  # a name made twice: FileExistsError
        f.truncate(byte_size)
    return path


def get_raw_handle(handle):
    return base64.b64encode(str(handle).encode())


def set_shared_memory_region(handle, input_values):
    with handle.open("r+b") as f:
        f.write(b"".join(np.ascontiguousarray(v).tobytes() for v in input_values))


def get_contents_as_numpy(handle, datatype, shape):
    return np.fromfile(handle, datatype, int(np.prod(shape))).reshape(shape)


def destroy_shared_memory_region(handle):
    handle.unlink()


@pytest.fixture
def regions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_DIR, str(tmp_path))  # the worker is spawned with this environment
    return tmp_path


def test_the_client_makes_writes_reads_and_frees_its_regions_in_another_process(regions_dir):
    with CudaClient(__name__, timeout_s=60) as client:
        assert client.pid != os.getpid()
        path = Path(base64.b64decode(client.create("in", 16)).decode())
        assert path == regions_dir / "in-on-0" and path.stat().st_size == 16
        client.write("in", [np.float32([0.5, 1.5]), np.int32([7])])
        assert client.read("in") == np.float32([0.5, 1.5]).tobytes() + np.int32([7]).tobytes() + bytes(4)
        client.create("out", 8, device_id=1)
        assert sorted(p.name for p in regions_dir.iterdir()) == ["in-on-0", "out-on-1"]
    assert list(regions_dir.iterdir()) == []  # freed at close


def test_an_error_in_the_client_process_is_raised_here_and_the_client_keeps_its_regions(regions_dir):
    with CudaClient(__name__, timeout_s=60) as client:
        client.create("in", 8)
        with pytest.raises(FileExistsError):
            client.create("in", 8)
        assert client.read("in") == bytes(8)
    assert list(regions_dir.iterdir()) == []
