"""A sticky CUDA error on a real GPU fails the engine's health probe (``TensorRTEngine.check_health``).

A kernel stores to an unmapped address: ``cudaErrorIllegalAddress``, which CUDA documents as
leaving the process unable to do any further CUDA work. The probe (``cudaMemGetInfo``) must then
fail, so Ray replaces the replica. It runs in a child process: the error poisons the process.
The kernel is hand-written PTX, loaded through the driver API (no compiler needed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.gpu.conftest import requires_cuda

pytestmark = requires_cuda

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import ctypes
from types import SimpleNamespace
from cuda.bindings import driver
from deployments.runtime.backends import cuda
from deployments.runtime.backends.tensorrt import TensorRTEngine
from deployments.runtime.contract.errors import EngineFault

PTX = b"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry poke(.param .u64 p)
{
  .reg .b64 %rd<2>;
  .reg .b32 %r<2>;
  ld.param.u64 %rd1, [p];
  mov.u32 %r1, 1;
  st.global.u32 [%rd1], %r1;
  ret;
}
"""
engine = SimpleNamespace(_engine=object(), _memory=cuda.CudaMemory(), config=SimpleNamespace(name="m"))
TensorRTEngine.check_health(engine)
print("healthy before")
err, module = driver.cuModuleLoadData(PTX)
assert int(err) == 0, err
err, poke = driver.cuModuleGetFunction(module, b"poke")
assert int(err) == 0, err
err, = driver.cuLaunchKernel(poke, 1, 1, 1, 1, 1, 1, 0, 0, ((0x8,), (ctypes.c_void_p,)), 0)
print("launch", err.name)
rt = cuda._runtime()
print("synchronize", cuda.error_name(rt.cudaDeviceSynchronize()[0]))
for attempt in range(2):
    try:
        TensorRTEngine.check_health(engine)
        print("healthy after")
    except EngineFault as e:
        print("probe:", e.message)
'''


def test_an_illegal_address_fails_the_health_probe_from_then_on():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                           cwd=ROOT, env=env)
    print(child.stdout, child.stderr[-2000:])
    lines = child.stdout.splitlines()
    assert child.returncode == 0 and lines[:3] == ["healthy before", "launch CUDA_SUCCESS",
                                                   "synchronize cudaErrorIllegalAddress"]
    probe = ("probe: model 'm': the CUDA device is unusable (cudaMemGetInfo failed: cudaErrorIllegalAddress "
             "(700)); the process must restart")
    assert lines[3:] == [probe, probe]
