"""Triton's CUDA shared-memory extension on the GPU, through the replica's code path: a region
made with tritonclient's own ``cuda_shared_memory`` (cudaMalloc + cudaIpcGetMemHandle in this
process), registered, read as a model's input and written as its output by ONNX Runtime's CUDA
provider with no host copy (``SharedMemory`` -> ``ModelRoutes`` -> ``ModelHost`` ->
``OnnxRuntimeCudaContext``); outputs compared with the CPU provider's. Triton's
``simple_http_cudashm_client.py`` runs unmodified against a dedicated replica's routes for
``simple`` served on 127.0.0.1 (uvicorn) where ``TRITON_CLIENT_EXAMPLES`` names Triton's examples.

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
from deployments.protocol.shared_memory import CUDA, SharedMemory
from deployments.replica_routes import ModelRoutes
from deployments.routes import RouterOptions
from deployments.runtime.backends import onnxruntime_cuda
from deployments.runtime.contract.errors import SharedMemoryError
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.host import ModelHost
from deployments.shared_memory_routes import SharedMemoryRoutes
from tests.unit.test_shared_memory import DictStore

from .test_onnxruntime_cuda import assert_close, cpu_reference

REASON = onnxruntime_cuda.unavailable_reason()
try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except Exception as e:  # tritonclient or cuda-bindings 13 missing
    cudashm, REASON = None, REASON or f"tritonclient.utils.cuda_shared_memory does not import: {e}"
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CUDA shared memory cannot run here: {REASON}")

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = onnxruntime_cuda.TOLERANCE[True]  # the models' default: use_tf32


@pytest.fixture(scope="module")
def repo():
    return ModelRepository(ROOT / "engines")


@pytest.fixture
def memory():
    shared = SharedMemory(DictStore())
    yield shared
    shared.close()


@pytest.fixture
def region():
    """``make(name, byte_size)``: a CUDA region on device 0 (tritonclient's), destroyed after."""
    made = []

    def make(name, byte_size):
        made.append(cudashm.create_shared_memory_region(name, byte_size, 0))
        return made[-1]

    yield make
    for handle in made:
        cudashm.destroy_shared_memory_region(handle)


def register(memory, name, handle, byte_size):
    memory.registry.register(CUDA, name, {"raw_handle": {"b64": cudashm.get_raw_handle(handle).decode()},
                                          "device_id": 0, "byte_size": byte_size})


def infer_body(inputs, outputs):
    return [json.dumps({"inputs": inputs, "outputs": outputs}).encode()]


def shm(name, region, size, offset=0, **tensor):
    return {"name": name, **tensor, "parameters": {"shared_memory_region": region, "shared_memory_byte_size": size,
                                                   "shared_memory_offset": offset}}


@pytest.mark.parametrize("model", ["tiny_cnn", "resnet18"])
def test_input_and_output_in_cuda_shared_memory_equal_the_cpu_provider(repo, memory, region, model):
    entry = repo.get(model)
    host = ModelHost(entry, backend="onnxruntime_cuda").load()
    try:
        x = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
        logits = (2, 1000)
        in_bytes, out_bytes = x.nbytes, 2 * 1000 * 4
        gpu_in, gpu_out = region("in", 256 + in_bytes), region("out", 128 + out_bytes)
        cudashm.set_shared_memory_region(gpu_in, [np.zeros(64, np.float32), x])  # the input at offset 256
        register(memory, "in", gpu_in, 256 + in_bytes)
        register(memory, "out", gpu_out, 128 + out_bytes)

        async def run(request):
            return await asyncio.to_thread(host.infer, request.inputs, request.outputs)

        done = asyncio.run(answer(model, "1", True, infer_body(
            [shm("input", "in", in_bytes, 256, datatype="FP32", shape=list(x.shape))],
            [shm("logits", "out", out_bytes, 128)]), None, run, memory))
        head = json.loads(done.content)
        assert head["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": list(logits), "parameters": {
            "shared_memory_region": "out", "shared_memory_byte_size": out_bytes, "shared_memory_offset": 128}}]
        got = cudashm.get_contents_as_numpy(gpu_out, np.float32, [32 + 2000])[32:].reshape(logits)
        assert_close({"logits": got}, cpu_reference(entry, {"input": x}), TOLERANCE)
        assert memory.cuda.opened == 2  # each handle opened once in this process
        memory.registry.unregister(CUDA)
        assert memory.cuda.opened == 0  # closed at unregister (cudaIpcCloseMemHandle)
    finally:
        host.unload()


def test_an_output_region_too_small_is_400_and_the_replica_keeps_serving(repo, memory, region):
    host = ModelHost(repo.get("tiny_cnn"), backend="onnxruntime_cuda").load()
    try:
        x = np.ones((1, 3, 224, 224), np.float32)
        gpu_in, gpu_out = region("in", x.nbytes), region("out", 1000)
        cudashm.set_shared_memory_region(gpu_in, [x])
        register(memory, "in", gpu_in, x.nbytes)
        register(memory, "out", gpu_out, 1000)

        async def run(request):
            return await asyncio.to_thread(host.infer, request.inputs, request.outputs)

        body = infer_body([shm("input", "in", x.nbytes, datatype="FP32", shape=[1, 3, 224, 224])],
                          [shm("logits", "out", 1000)])
        with pytest.raises(SharedMemoryError) as raised:
            asyncio.run(answer("tiny_cnn", "1", True, body, None, run, memory))
        assert raised.value.message.startswith("shared memory size specified with the request for output 'logits' "
                                               "(1000 bytes) should be at least 4000 bytes to hold the results")
        assert host.infer({"input": x})["logits"].shape == (1, 1000)
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
