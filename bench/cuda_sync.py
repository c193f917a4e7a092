"""What waiting for the GPU costs the CPU: CUDA's wait modes side by side on ONNX Runtime CUDA.

With one CUDA context per process on a machine of many cores, CUDA's default
(``cudaDeviceScheduleAuto``) spins a core while a thread waits for its stream: every
``session.run_with_iobinding`` and ``cudaStreamSynchronize`` of a context holds a core busy for
the whole GPU time (CUDA Runtime API, ``cudaSetDeviceFlags``). With several replicas and the
HTTP path on the same cores, that busy-waiting competes with the work that needs them.
``cudaDeviceScheduleBlockingSync`` makes the waiting thread sleep on an OS primitive instead.

Each mode runs in fresh processes (the flag binds when the process's CUDA context is made):
``--procs`` processes at once (as many replicas on one GPU), each a ``ModelHost`` with one
context called in a closed loop from one thread for ``--duration-s``. Per point: calls/s (all
processes), p50 ms per call (median of the processes' p50), and CPU ms per call (the
processes' CPU time over the loop / their calls).

    python -m bench.cuda_sync --models tiny_cnn,resnet18 --procs 1,8 --batches 1,8

Results: ``bench/results/cuda-sync-<time>.json`` (and the table printed). Needs onnxruntime-gpu,
cuda-python and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from deployments.runtime.backends.cuda import WAIT_MODES

ROOT = Path(__file__).resolve().parents[1]


def child(a: argparse.Namespace) -> None:
    from bench.gpu_engine import SHAPES, closed_loop, with_instances
    from deployments.runtime.backends.onnxruntime_cuda import CUDA_WAIT_ENV
    from deployments.runtime.contract.repository import ModelRepository
    from deployments.runtime.residency.host import ModelHost

    os.environ[CUDA_WAIT_ENV] = a.mode  # the backend's prime() sets it before the context exists
    repo = ModelRepository(a.repository)
    host = ModelHost(with_instances(repo.get(a.model), 1), "onnxruntime_cuda").load()
    x = np.random.default_rng(0).random((a.batch,) + SHAPES[a.model], dtype=np.float32)
    closed_loop(host, x, 1, 0.3)  # warm
    print("READY", flush=True)
    sys.stdin.readline()  # all processes start together
    cpu0 = time.process_time()
    r = closed_loop(host, x, 1, a.duration_s)
    cpu = time.process_time() - cpu0
    calls = r["calls_per_s"] * a.duration_s
    print(json.dumps({**r, "cpu_ms_per_call": round(1e3 * cpu / max(calls, 1), 3)}), flush=True)
    host.unload()


def point(a: argparse.Namespace, mode: str, model: str, batch: int, procs: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.cuda_sync", "_child", "--mode", mode, "--model", model,
           "--batch", str(batch), "--duration-s", str(a.duration_s), "--repository", a.repository]
    children = [subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(procs)]
    for c in children:
        while (line := c.stdout.readline()).strip() != "READY":
            if not line:
                raise RuntimeError(f"a {mode} child did not start (its stderr is above)")
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    results = []
    for c in children:
        out, _ = c.communicate(timeout=120)
        results.append(json.loads(out.strip().splitlines()[-1]))
    calls = sum(r["calls_per_s"] for r in results)
    return {"mode": mode, "model": model, "batch": batch, "procs": procs, "calls_per_s": round(calls, 1),
            "rows_per_s": round(calls * batch, 1), "p50_ms": round(statistics.median(r["p50_ms"] for r in results), 3),
            "cpu_ms_per_call": round(statistics.mean(r["cpu_ms_per_call"] for r in results), 3)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repository", default=str(ROOT / "engines"))
    if argv[:1] == ["_child"]:
        p.add_argument("--mode", choices=sorted(WAIT_MODES))
        p.add_argument("--model")
        p.add_argument("--batch", type=int)
        p.add_argument("--duration-s", type=float)
        child(p.parse_args(argv[1:]))
        return
    p.add_argument("--models", default="tiny_cnn,resnet18")
    p.add_argument("--modes", default="auto,blocking")
    p.add_argument("--procs", default="1,8")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--duration-s", type=float, default=2.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    rows = []
    for model in a.models.split(","):
        for batch in map(int, a.batches.split(",")):
            for procs in map(int, a.procs.split(",")):
                for mode in a.modes.split(","):  # modes side by side at each point
                    row = point(a, mode, model, batch, procs)
                    rows.append(row)
                    print(f"{mode:9} {model:9} b={batch:<2} procs={procs:<2} {row['rows_per_s']:9.1f} rows/s "
                          f"p50 {row['p50_ms']} ms  CPU {row['cpu_ms_per_call']} ms/call", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cuda-sync-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"command": "python -m bench.cuda_sync " + " ".join(argv), "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
