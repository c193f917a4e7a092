"""What a GPU model call costs the calling thread: the blocking call a replica makes today against
launching the same work and waiting for its completion apart.

For each model and batch, on one ONNX Runtime CUDA context (``OnnxRuntimeCudaContext``, as a
replica holds it), in one process:

* ``sync``: ``context.infer`` (host -> device copy, the run, device -> host copy, stream
  synchronized): wall p50 and the calling thread's CPU per call (``time.thread_time``; under
  CUDA's ``auto`` wait that includes the spin).
* ``launch``: the same copies and run enqueued without waiting (``RunOptions``
  ``disable_synchronize_execution_providers``, the output copied into pinned host memory, a CUDA
  event recorded): the CPU and wall until the launch returns, then the wall until the event is
  done, waited by polling ``cudaEventQuery`` with ``--poll-us`` sleeps (what an event loop
  would do between other work).
* ``hop``: ``await asyncio.to_thread(no-op)`` on an asyncio loop (uvloop where installed, as
  Serve's replicas run): wall and process CPU per hop, the cost the ``launch`` path saves.

    python -m bench.gpu_launch --models resnet18,tiny_cnn --batches 1,8 --calls 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _p50_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1)


def measure_model(repository: str, model: str, batches: Sequence[int], calls: int, poll_us: float,
                  graphs: bool) -> list[dict]:
    import onnxruntime as ort

    from deployments.runtime.backends import cuda
    from deployments.runtime.backends.onnxruntime_cuda import OnnxRuntimeCudaEngine, _HostArray
    from deployments.runtime.contract.datatypes import NUMPY_BY_DATATYPE
    from deployments.runtime.contract.repository import ModelRepository
    from deployments.runtime.residency.host import engine_config

    entry = ModelRepository(repository, [model]).get(model)
    config = engine_config(entry.config)
    config = config.model_copy(update={"onnxruntime_cuda": config.onnxruntime_cuda.model_copy(
        update={"cuda_graphs": graphs})})
    engine = OnnxRuntimeCudaEngine(config, entry.onnx_path(entry.latest).parent)
    context = engine.create_context()
    rt = cuda._runtime()
    event = cuda.check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreate")
    no_sync = ort.RunOptions()
    no_sync.add_run_config_entry("disable_synchronize_execution_providers", "1")
    pinned: dict[str, Any] = {}
    rows = []
    print(json.dumps({"model": model, "cuda_graphs": graphs, "context": context.graphs_reason}), flush=True)
    all_feeds = {}
    for batch in batches:
        rng = np.random.default_rng(0)
        feeds = {}
        for spec in config.inputs:
            dims = [batch] + [d if d > 0 else 1 for d in spec.dims[1:]] if config.max_batch_size else list(spec.dims)
            feeds[spec.name] = (rng.random(dims) * 2 - 1).astype(NUMPY_BY_DATATYPE[spec.datatype])
        all_feeds[batch] = feeds
        for _ in range(20):
            expected = context.infer(feeds)
        walls, cpus = [], []
        for _ in range(calls):
            w, c = time.perf_counter(), time.thread_time()
            context.infer(feeds)
            cpus.append(time.thread_time() - c)
            walls.append(time.perf_counter() - w)

        def launch() -> dict[str, np.ndarray]:
            binding, memory, stream = context.binding, engine.memory, context.stream
            for name, array in feeds.items():
                buf = context._inputs[name]
                memory.copy_to_device(buf, _HostArray(array), array.nbytes, stream)
                binding.bind_input(name, "cuda", engine.device_id, array.dtype.type, list(array.shape), buf.ptr)
            outs = {}
            for spec in config.outputs:
                shape = context._static_output_shape(spec.name, batch)
                dtype = NUMPY_BY_DATATYPE[spec.datatype]
                binding.bind_output(spec.name, "cuda", engine.device_id, dtype.type, list(shape),
                                    context._outputs[spec.name].ptr)
                host = pinned.setdefault(spec.name, engine.memory.host_buffer())
                host.ensure(int(np.prod(shape)) * dtype.itemsize)
                outs[spec.name] = (host, shape, dtype)
            context.session.run_with_iobinding(binding, no_sync)
            for name, (host, shape, dtype) in outs.items():
                memory.copy_to_host(host, context._outputs[name], int(np.prod(shape)) * dtype.itemsize, stream)
            cuda.check(rt.cudaEventRecord(event, stream.handle), "cudaEventRecord")
            return outs

        def done() -> bool:
            err = rt.cudaEventQuery(event)[0]
            if int(err) == 0:
                return True
            if err == rt.cudaError_t.cudaErrorNotReady:
                return False
            raise RuntimeError(f"cudaEventQuery: {err}")

        launch_walls, launch_cpus, total_walls, polls = [0.0], [0.0], [0.0], [0]
        for i in range(0 if graphs else calls + 20):
            w, c = time.perf_counter(), time.thread_time()
            outs = launch()
            lc, lw = time.thread_time() - c, time.perf_counter() - w
            n = 0
            while not done():
                n += 1
                time.sleep(poll_us / 1e6)
            tw = time.perf_counter() - w
            got = {k: h.view(d, s).copy() for k, (h, s, d) in outs.items()}
            if i < 20:
                for k in expected:
                    np.testing.assert_allclose(got[k], expected[k], rtol=1e-3, atol=1e-3)
                continue
            launch_walls.append(lw), launch_cpus.append(lc), total_walls.append(tw), polls.append(n)
        binding = context.binding
        binding.clear_binding_inputs(), binding.clear_binding_outputs()
        rows.append({"model": model, "cuda_graphs": graphs, "batch": batch, "request_bytes": sum(a.nbytes for a in feeds.values()),
                     "sync_wall_us": _p50_us(walls), "sync_cpu_us": _p50_us(cpus),
                     "launch_wall_us": _p50_us(launch_walls), "launch_cpu_us": _p50_us(launch_cpus),
                     "launch_done_wall_us": _p50_us(total_walls), "polls": statistics.median(polls)})
        print(json.dumps(rows[-1]), flush=True)
    if len(all_feeds) > 1:  # shapes alternating on one context, each answer checked
        firsts = {b: context.infer(f) for b, f in all_feeds.items()}
        walls = []
        for i in range(calls):
            batch = list(all_feeds)[i % len(all_feeds)]
            w = time.perf_counter()
            got = context.infer(all_feeds[batch])
            walls.append(time.perf_counter() - w)
            for k, v in firsts[batch].items():
                np.testing.assert_allclose(got[k], v, rtol=1e-3, atol=1e-3)
        rows.append({"model": model, "cuda_graphs": graphs, "alternating": list(all_feeds),
                     "wall_us_per_call": _p50_us(walls)})
        print(json.dumps(rows[-1]), flush=True)
    context.close()
    return rows


async def hop(calls: int) -> dict[str, Any]:
    def nothing() -> None:
        return None

    for _ in range(100):
        await asyncio.to_thread(nothing)
    walls = []
    cpu = time.process_time()
    for _ in range(calls):
        w = time.perf_counter()
        await asyncio.to_thread(nothing)
        walls.append(time.perf_counter() - w)
    cpu = time.process_time() - cpu
    return {"hop": "asyncio.to_thread", "loop": type(asyncio.get_running_loop()).__module__,
            "wall_us": _p50_us(walls), "process_cpu_us": round(cpu * 1e6 / calls, 1)}


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,tiny_cnn")
    p.add_argument("--repository", default=str(ROOT / "engines"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--poll-us", type=float, default=50.0)
    p.add_argument("--graphs", default="off,on", help="onnxruntime_cuda.cuda_graphs of the context: off, on")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for graphs in args.graphs.split(","):
            rows += measure_model(args.repository, model, [int(b) for b in args.batches.split(",")], args.calls,
                                  args.poll_us, graphs == "on")
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    hops = runner(hop(args.calls * 4))
    print(json.dumps(hops), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "hop": hops}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
