"""What a GPU model's load and unload leave behind in this process (ONNX Runtime CUDA).

Loads and unloads a model again and again, running requests between, and prints NVML's
per-process bytes over the primed baseline after each unload: a figure that climbs is memory
the process keeps across loads (the pool's cache counts it as ``gpu_growth_bytes``).

    python -m bench.gpu_retained [--model resnet18] [--cycles 10] [--threads 1,8] [--copies] [--batches 1,3,8]

``--threads N``: requests from N threads (each thread its own) between a load and its unload;
``--copies``: each cycle loads a copy of the model under another name (a fresh folder), as the
placement benchmark's long tail does. Prints one line per cycle and a summary per variant.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from deployments.runtime.backends import gpu_memory, onnxruntime_cuda
from deployments.runtime.backends.gpu_memory import process_gpu_bytes
from deployments.runtime.contract.datatypes import NUMPY_BY_DATATYPE
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.contract.shapes import max_profile_shapes
from deployments.runtime.residency.host import ModelHost

MB = 1 << 20


def requests_at(root: Path, model: str, batches: list[int]) -> list[dict[str, np.ndarray]]:
    """Random inputs for ``model`` at each of ``batches`` (its max profile's other dims)."""
    rng = np.random.default_rng(0)
    config = ModelRepository(root, [model]).get(model).config
    shapes = max_profile_shapes(config)
    return [{spec.name: rng.random((b, *shapes[spec.name][1:])).astype(NUMPY_BY_DATATYPE[spec.datatype])
             for spec in config.inputs} for b in batches]


def run(root: Path, model: str, cycles: int, threads: int, copies: bool, batches: list[int]) -> list[float]:
    base = gpu_memory.baseline.bytes
    xs = requests_at(root, model, batches)
    left = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(threads) as pool:
        for cycle in range(cycles):
            name = f"{model}_{cycle}" if copies else model
            if copies:
                shutil.copytree(root / model, Path(tmp) / name)
                repo = ModelRepository(Path(tmp), [name])
            else:
                repo = ModelRepository(root, [model])
            host = ModelHost(repo.get(name), "onnxruntime_cuda").load()
            loaded = process_gpu_bytes().bytes - base
            list(pool.map(lambda i: host.infer(xs[i % len(xs)]), range(max(4 * threads, 2 * len(xs)))))
            ran = process_gpu_bytes().bytes - base
            host.unload()
            del host
            gc.collect()
            left.append((process_gpu_bytes().bytes - base) / MB)
            print(f"  cycle {cycle}: loaded {loaded / MB:.1f} MiB, after requests {ran / MB:.1f} MiB, "
                  f"after unload {left[-1]:.1f} MiB", flush=True)
    return left


def resident(root: Path, model: str, count: int, threads: int, batches: list[int]) -> None:
    """``count`` copies of ``model`` loaded one after another into one ``ModelCache`` (no budget)
    while ``threads`` threads send requests to the copies already loaded: after each load, the
    cache's resident bytes (the footprints), its GPU growth and NVML's reading over the baseline."""
    import random
    import threading

    from deployments.runtime.contract.config import CacheOptions
    from deployments.runtime.residency.cache import ModelCache

    base = gpu_memory.baseline.bytes
    xs = requests_at(root, model, batches)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"{model}_{k}" for k in range(count)]
        for name in names:
            shutil.copytree(root / model, Path(tmp) / name)
        cache = ModelCache(ModelRepository(Path(tmp), names), names, CacheOptions(load_policy="lru"),
                           backend="onnxruntime_cuda").start()
        loaded: list[str] = []
        stop = threading.Event()

        def send() -> None:
            pick = random.Random(threading.get_ident())
            while not stop.is_set():
                if loaded:
                    cache.infer(pick.choice(loaded), pick.choice(xs))

        workers = [threading.Thread(target=send) for _ in range(threads)]
        for w in workers:
            w.start()
        try:
            for name in names:
                cache.infer(name, xs[0])
                loaded.append(name)
                status = cache.status()
                print(f"  {len(loaded)} resident: footprints {cache.resident_bytes / MB:.1f} MiB, growth "
                      f"{status['gpu_growth_bytes'] / MB:.1f} MiB, NVML over base "
                      f"{(process_gpu_bytes().bytes - base) / MB:.1f} MiB", flush=True)
            stop.wait(3)
            print(f"  after 3 s more requests: NVML over base {(process_gpu_bytes().bytes - base) / MB:.1f} MiB, "
                  f"footprints {cache.resident_bytes / MB:.1f} MiB", flush=True)
            gone = names[::2]
            loaded[:] = names[1::2]
            for name in gone:
                cache.unload(name)
            print(f"  half unloaded: NVML over base {(process_gpu_bytes().bytes - base) / MB:.1f} MiB, "
                  f"footprints {cache.resident_bytes / MB:.1f} MiB", flush=True)
            for name in gone:
                cache.load(name)
                cache.infer(name, xs[0])
            loaded[:] = names
            print(f"  loaded again: NVML over base {(process_gpu_bytes().bytes - base) / MB:.1f} MiB, "
                  f"footprints {cache.resident_bytes / MB:.1f} MiB; events "
                  f"{[(e['event'], e['model'][-3:], e['model_bytes'] // MB, e.get('gpu_over_baseline_bytes', 0) // MB) for e in cache.timeline()]}",
                  flush=True)
        finally:
            stop.set()
            for w in workers:
                w.join()
            cache.close()
        gc.collect()
        print(f"  all unloaded: NVML over base {(process_gpu_bytes().bytes - base) / MB:.1f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="engines")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--threads", default="1,8")
    parser.add_argument("--copies", action="store_true")
    parser.add_argument("--batches", default="2", help="request batch sizes, in turn (e.g. 1,2,3,5,8)")
    parser.add_argument("--resident", type=int, default=0,
                        help="instead: this many copies loaded side by side under requests (``resident``)")
    args = parser.parse_args()
    onnxruntime_cuda.prime()
    if args.resident:
        for threads in (int(t) for t in args.threads.split(",")):
            print(f"{args.model}: {args.resident} copies resident, {threads} request thread(s)", flush=True)
            resident(Path(args.root), args.model, args.resident, threads, [int(b) for b in args.batches.split(",")])
        return
    for threads in (int(t) for t in args.threads.split(",")):
        for copies in ((False, True) if args.copies else (False,)):
            print(f"{args.model}: {threads} thread(s), {'copies' if copies else 'same folder'}", flush=True)
            left = run(Path(args.root), args.model, args.cycles, threads, copies,
                       [int(b) for b in args.batches.split(",")])
            print(f"  retained after unload: first {left[0]:.1f} MiB, last {left[-1]:.1f} MiB, "
                  f"per cycle after the first {(left[-1] - left[0]) / max(1, len(left) - 1):.2f} MiB", flush=True)


if __name__ == "__main__":
    main()
