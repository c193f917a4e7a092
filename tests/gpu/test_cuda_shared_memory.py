"""Triton's CUDA shared-memory extension on the GPU, through the replica's code path: a region
made with tritonclient's own ``cuda_shared_memory`` (cudaMalloc + cudaIpcGetMemHandle) by a client
in another process (``CudaClient``: CUDA opens an IPC handle only outside the process that made
it), registered, read as a model's input and written as its output by ONNX Runtime's CUDA provider
in this process with no host copy (``SharedMemory`` -> ``ModelRoutes`` -> ``ModelHost`` ->
``OnnxRuntimeCudaContext``); outputs, read back by the client, compared with the CPU provider's.
Triton's ``simple_http_cudashm_client.py`` runs unmodified against a dedicated replica's routes
for ``simple`` served on 127.0.0.1 (uvicorn) where ``TRITON_CLIENT_EXAMPLES`` names Triton's
examples.

Skipped, with the reason, where ONNX Runtime's CUDA provider cannot run, or tritonclient's CUDA
shared-memory module (cuda-bindings 13) is missing. A real Ray Serve app is not started here (no
tests/gpu test does): the replica's routes are the same objects a Ray replica serves.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from deployments.protocol.answer import answer
from deployments.protocol.errors import error_status
from deployments.protocol.shared_memory import CUDA, SharedMemory
from deployments.replica_routes import ModelRoutes
from deployments.routes import RouterOptions
from deployments.runtime.backends import onnxruntime_cuda
from deployments.runtime.contract.errors import SharedMemoryError
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.host import ModelHost
from deployments.shared_memory_routes import SharedMemoryRoutes
from tests.unit.test_shared_memory import DictStore

from .cuda_client import CudaClient
from .test_onnxruntime_cuda import assert_close, cpu_reference

REASON = onnxruntime_cuda.unavailable_reason()
try:
    import tritonclient.utils.cuda_shared_memory  # noqa: F401 (CudaClient's worker makes the regions with it)
except Exception as e:  # tritonclient or cuda-bindings 13 missing
    REASON = REASON or f"tritonclient.utils.cuda_shared_memory does not import: {e}"
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CUDA shared memory cannot run here: {REASON}")

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = onnxruntime_cuda.TOLERANCE[True]  # the models' default: use_tf32


@pytest.fixture(scope="module")
def repo():
    return ModelRepository(ROOT / "engines")


@pytest.fixture
def client():
    """The client side in another process: it makes the CUDA regions on device 0 (the replica
    opens their handles here), writes inputs, reads outputs, and frees the regions after."""
    with CudaClient() as made:
        assert made.pid != os.getpid()
        yield made


@pytest.fixture
def memory(client):
    """The replica's ``SharedMemory``, set up after ``client`` and so torn down before it: its
    openings close before the client frees the memory they map."""
    shared = SharedMemory(DictStore())
    yield shared
    shared.close()


def register(memory, name, raw_handle, byte_size):
    memory.registry.register(CUDA, name, {"raw_handle": {"b64": raw_handle}, "device_id": 0, "byte_size": byte_size})


def infer_body(inputs, outputs):
    return [json.dumps({"inputs": inputs, "outputs": outputs}).encode()]


def shm(name, region, size, offset=0, **tensor):
    return {"name": name, **tensor, "parameters": {"shared_memory_region": region, "shared_memory_byte_size": size,
                                                   "shared_memory_offset": offset}}


def infer_in_shm(host, model, memory, body):
    """``body`` answered as the replica answers it: ``answer`` through ``memory`` and ``host``."""
    async def run(request):
        return await asyncio.to_thread(host.infer, request.inputs, request.outputs)

    return json.loads(asyncio.run(answer(model, "1", True, body, None, run, memory)).content)


def logits_from(client, region, offset, shape):
    """FP32 ``shape`` at byte ``offset`` of ``region``, as the client reads it back."""
    return np.frombuffer(client.read(region), np.float32, int(np.prod(shape)), offset).reshape(shape)


@pytest.mark.parametrize("model", ["tiny_cnn", "resnet18"])
def test_input_and_output_in_cuda_shared_memory_equal_the_cpu_provider(repo, client, memory, model):
    entry = repo.get(model)
    host = ModelHost(entry, backend="onnxruntime_cuda").load()
    try:
        x = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
        logits = (2, 1000)
        in_bytes, out_bytes = x.nbytes, 2 * 1000 * 4
        in_handle, out_handle = client.create("in", 256 + in_bytes), client.create("out", 128 + out_bytes)
        client.write("in", [np.zeros(64, np.float32), x])  # the input at offset 256
        register(memory, "in", in_handle, 256 + in_bytes)
        register(memory, "out", out_handle, 128 + out_bytes)

        head = infer_in_shm(host, model, memory, infer_body(
            [shm("input", "in", in_bytes, 256, datatype="FP32", shape=list(x.shape))],
            [shm("logits", "out", out_bytes, 128)]))
        assert head["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": list(logits), "parameters": {
            "shared_memory_region": "out", "shared_memory_byte_size": out_bytes, "shared_memory_offset": 128}}]
        got = logits_from(client, "out", 128, logits)
        assert_close({"logits": got}, cpu_reference(entry, {"input": x}), TOLERANCE)
        assert memory.cuda.opened == 2  # each handle opened once in this (the replica's) process
        memory.registry.unregister(CUDA)
        assert memory.cuda.opened == 0  # closed at unregister (cudaIpcCloseMemHandle)
    finally:
        host.unload()


def test_an_output_region_too_small_is_400_and_the_replica_keeps_serving(repo, client, memory):
    entry = repo.get("tiny_cnn")
    host = ModelHost(entry, backend="onnxruntime_cuda").load()
    try:
        x = np.ones((1, 3, 224, 224), np.float32)
        in_handle = client.create("in", x.nbytes)
        client.write("in", [x])
        register(memory, "in", in_handle, x.nbytes)
        register(memory, "small", client.create("small", 1000), 1000)
        register(memory, "out", client.create("out", 4000), 4000)
        given = [shm("input", "in", x.nbytes, datatype="FP32", shape=[1, 3, 224, 224])]

        with pytest.raises(SharedMemoryError) as raised:
            infer_in_shm(host, "tiny_cnn", memory, infer_body(given, [shm("logits", "small", 1000)]))
        status, message = error_status(raised.value)  # as the routes answer it
        assert status == 400
        assert message.startswith("shared memory size specified with the request for output 'logits' "
                                  "(1000 bytes) should be at least 4000 bytes to hold the results")
        infer_in_shm(host, "tiny_cnn", memory, infer_body(given, [shm("logits", "out", 4000)]))
        assert_close({"logits": logits_from(client, "out", 0, (1, 1000))}, cpu_reference(entry, {"input": x}),
                     TOLERANCE)
    finally:
        host.unload()


class ReplicaWithRegister(SharedMemoryRoutes, ModelRoutes):
    """A dedicated replica's routes with the register routes the router serves beside them:
    what Triton's example reaches at one address."""


@pytest.fixture
def simple_url(repo):
    """``simple`` on ONNX Runtime's CUDA provider behind its replica's routes, on a free port."""
    import uvicorn

    entry = repo.get("simple")
    host = ModelHost(entry, backend="onnxruntime_cuda").load()

    async def infer(inputs, outputs=None, version=None):
        return await asyncio.to_thread(host.infer, inputs, outputs)

    routes = ReplicaWithRegister(entry, ModelRepository(ROOT / "engines", ["simple"]), infer,
                                 RouterOptions(max_body_bytes=1 << 26, request_timeout_s=60))
    routes.shared_memory = SharedMemory(DictStore())
    routes.model_loaded(host.backend)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(routes.build_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start within 30 s"
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
    routes.shared_memory.close()
    host.unload()


EXAMPLES = os.environ.get("TRITON_CLIENT_EXAMPLES", "")


@pytest.mark.skipif(not EXAMPLES or not Path(EXAMPLES).is_dir(),
                    reason="TRITON_CLIENT_EXAMPLES names no checkout of Triton's client examples")
def test_tritons_cuda_shared_memory_example_exits_0(simple_url):
    done = subprocess.run([sys.executable, "simple_http_cudashm_client.py", "-u", simple_url], cwd=EXAMPLES,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
