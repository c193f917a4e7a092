"""The in-process engine ceiling on a GPU against the CPU, plus the GPU facts the server relies on.

No HTTP, no Ray: ``ModelHost`` (engine + pool of contexts) called from T threads in a closed
loop, per model, backend, batch size and thread count; the OCR pipeline (``OcrPipeline`` over
local hosts) on the real PNG at C concurrent images. Also: max |GPU - CPU provider| per model
with TF32 on and off, what NVML reports for this process (per-process bytes or not), the
one-time cost of the CUDA context and libraries (``onnxruntime_cuda.prime``), each model's GPU
footprint, and the bytes left after unloading it.

    python -m bench.gpu_engine                      # on a machine with onnxruntime-gpu and a GPU
    python -m bench.gpu_engine --backends onnxruntime --duration-s 1   # CPU only

Results: ``bench/results/gpu-engine-<time>.json`` and ``.md`` (printed too).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # one row of each model's input at a typical size
    "tiny_cnn": (3, 224, 224), "mid_cnn": (3, 224, 224), "resnet18": (3, 224, 224),
    "ocr_cls": (3, 48, 192), "ocr_rec": (3, 48, 320), "ocr_det": (3, 640, 640),
}
MB = 1_000_000


def closed_loop(host: Any, x: np.ndarray, threads: int, duration_s: float) -> dict[str, Any]:
    """``threads`` threads calling ``host.infer`` on ``x`` for ``duration_s`` after a warm-up
    call each; returns calls/s, rows/s and the per-call p50/p99 in ms."""
    name = host.config.inputs[0].name
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + duration_s

    def worker() -> None:
        host.infer({name: x})
        mine = []
        while True:  # at least one timed call, however slow
            t0 = time.perf_counter()
            host.infer({name: x})
            mine.append(time.perf_counter() - t0)
            if time.perf_counter() >= stop:
                break
        with lock:
            latencies.extend(mine)

    start = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    calls = len(latencies)
    return {"calls_per_s": round(calls / elapsed, 1), "rows_per_s": round(calls * x.shape[0] / elapsed, 1),
            "p50_ms": round(1e3 * latencies[calls // 2], 3) if calls else None,
            "p99_ms": round(1e3 * latencies[min(calls - 1, int(calls * 0.99))], 3) if calls else None}


def with_instances(entry: Any, instances: int, **cuda_options: Any) -> Any:
    config = entry.config.model_copy(update={"instances": instances})
    if cuda_options:
        config = config.model_copy(update={"onnxruntime_cuda": config.onnxruntime_cuda.model_copy(update=cuda_options)})
    return dataclasses.replace(entry, config=config)


def engine_rows(repo: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    from deployments.runtime.backends.gpu_memory import process_gpu_bytes
    from deployments.runtime.residency.host import ModelHost

    rows = []
    rng = np.random.default_rng(0)
    for backend in a.backends:
        for model in a.models:
            entry = repo.get(model)
            top = entry.config.max_batch_size or 1
            threads_list = a.threads if backend != "onnxruntime" else [max(a.threads)]
            t0 = time.perf_counter()
            before = process_gpu_bytes().bytes if backend != "onnxruntime" else 0
            host = ModelHost(with_instances(entry, max(threads_list)), backend).load()
            load_s = time.perf_counter() - t0
            footprint = host.footprint()
            gpu_used = process_gpu_bytes().bytes - before if backend != "onnxruntime" else None
            try:
                for batch in [b for b in a.batches if b <= top]:
                    x = rng.random((batch,) + SHAPES[model], dtype=np.float32)
                    for threads in threads_list:
                        r = closed_loop(host, x, threads, a.duration_s)
                        rows.append({"backend": backend, "model": model, "batch": batch, "threads": threads,
                                     **r, "load_s": round(load_s, 2), "context_mb": round(footprint.context_bytes / MB, 1),
                                     "gpu_growth_mb": None if gpu_used is None else round(gpu_used / MB, 1)})
                        print(f"engine {backend:16} {model:9} b={batch:<2} t={threads:<2} {r['rows_per_s']:9.1f} rows/s "
                              f"p50 {r['p50_ms']} ms", flush=True)
            finally:
                host.unload()
    return rows


def switch_rows(repo: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Per model and backend, one context, one thread: ms per call when every call has the
    same batch size (``b1``, ``b2``) against calls alternating between them (``b1<->b2``, what
    dynamic batching feeds a context). At most ``--switch-calls`` timed calls or
    ``--duration-s`` per pattern, after one untimed call of each size."""
    from deployments.runtime.residency.host import ModelHost

    rows = []
    rng = np.random.default_rng(0)
    for backend in a.backends:
        for model in a.models:
            host = ModelHost(with_instances(repo.get(model), 1), backend).load()
            name = host.config.inputs[0].name
            xs = {b: rng.random((b,) + SHAPES[model], dtype=np.float32) for b in (1, 2)}
            try:
                for b in xs:
                    host.infer({name: xs[b]})
                for label, sizes in (("b1", (1,)), ("b2", (2,)), ("b1<->b2", (1, 2))):
                    times: list[float] = []
                    stop = time.perf_counter() + a.duration_s
                    while len(times) < a.switch_calls and time.perf_counter() < stop:
                        x = xs[sizes[len(times) % len(sizes)]]
                        t0 = time.perf_counter()
                        host.infer({name: x})
                        times.append(time.perf_counter() - t0)
                    rows.append({"backend": backend, "model": model, "pattern": label, "calls": len(times),
                                 "p50_ms": round(1e3 * statistics.median(times), 3),
                                 "max_ms": round(1e3 * max(times), 3)})
                    print(f"switch {backend:16} {model:9} {label:8} p50 {rows[-1]['p50_ms']} ms "
                          f"({len(times)} calls)", flush=True)
            finally:
                host.unload()
    return rows


def accuracy_rows(repo: Any, models: Sequence[str]) -> list[dict[str, Any]]:
    """max |GPU - CPU| (and relative to max(1, |CPU|)) per model at batch 4 (ocr_det: 1), TF32 on/off."""
    import onnxruntime as ort

    from deployments.runtime.residency.host import ModelHost

    rows = []
    rng = np.random.default_rng(1)
    for model in models:
        entry = repo.get(model)
        x = rng.random((min(4, entry.config.max_batch_size or 1),) + SHAPES[model], dtype=np.float32)
        feeds = {entry.config.inputs[0].name: x}
        cpu = ort.InferenceSession(str(entry.onnx_path()), providers=["CPUExecutionProvider"]).run(None, feeds)
        for tf32 in (True, False):
            host = ModelHost(with_instances(entry, 1, use_tf32=tf32), "onnxruntime_cuda").load()
            try:
                gpu = list(host.infer(feeds).values())
            finally:
                host.unload()
            diff = max(float(np.abs(g - c).max()) for g, c in zip(gpu, cpu))
            rel = max(float((np.abs(g - c) / np.maximum(1.0, np.abs(c))).max()) for g, c in zip(gpu, cpu))
            rows.append({"model": model, "tf32": tf32, "max_abs_diff": diff, "max_rel_diff": rel,
                         "max_abs_output": max(float(np.abs(c).max()) for c in cpu)})
            print(f"accuracy {model:9} tf32={tf32!s:5} max|diff| {diff:.3g} rel {rel:.3g}", flush=True)
    return rows


def memory_facts(repo: Any, models: Sequence[str]) -> dict[str, Any]:
    """What NVML reports for this process, the prime cost, footprints and what unload returns."""
    from deployments.runtime.backends import cuda, gpu_memory, onnxruntime_cuda
    from deployments.runtime.residency.host import ModelHost

    facts: dict[str, Any] = {"nvml_process_bytes_before_cuda": gpu_memory.nvml_process_bytes()}
    free0, total = cuda.mem_get_info()
    t0 = time.perf_counter()
    onnxruntime_cuda.prime()
    facts.update(prime_s=round(time.perf_counter() - t0, 2), device_total_mb=round(total / MB),
                 after_prime=dataclasses.asdict(gpu_memory.process_gpu_bytes()),
                 device_used_delta_prime_mb=round((free0 - cuda.mem_get_info()[0]) / MB, 1),
                 nvml_processes=gpu_memory.nvml_processes(), pid=os.getpid())
    per_model = []
    for model in models:
        entry = repo.get(model)
        before = gpu_memory.process_gpu_bytes().bytes
        dev_before = cuda.mem_get_info()[0]
        host = ModelHost(entry, "onnxruntime_cuda").load()
        loaded = gpu_memory.process_gpu_bytes().bytes
        dev_loaded = cuda.mem_get_info()[0]
        fp = host.footprint()
        host.unload()
        after = gpu_memory.process_gpu_bytes().bytes
        per_model.append({"model": model, "instances": entry.config.instances,
                          "context_mb": round(fp.context_bytes / MB, 1),
                          "footprint_total_mb": round(fp.total(entry.config.instances) / MB, 1),
                          "process_growth_mb": round((loaded - before) / MB, 1),
                          "device_growth_mb": round((dev_before - dev_loaded) / MB, 1),
                          "left_after_unload_mb": round((after - before) / MB, 1),
                          "gpu_mem_limit_mib": entry.config.onnxruntime_cuda.gpu_mem_limit_mib})
        print("memory", per_model[-1], flush=True)
    facts["models"] = per_model
    return facts


def pipeline_rows(repo: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    """The OCR pipeline over local hosts: images/s on the real PNG at each concurrency."""
    from deployments.pipelines import create_pipeline
    from deployments.runtime.residency.host import ModelHost

    image = np.array([(ROOT / "tests" / "data" / "ocr_sample.png").read_bytes()], dtype=object)
    rows = []
    for backend in a.backends:
        hosts = {n: ModelHost(repo.get(n), backend).load() for n in ("ocr_det", "ocr_cls", "ocr_rec")}

        async def step(name: str, inputs: dict) -> dict:
            return await asyncio.to_thread(hosts[name].infer, inputs)

        pipeline = create_pipeline(repo, "ocr", step)

        async def run(concurrency: int) -> dict[str, Any]:
            text = (await pipeline.infer({"image": image}))["text"]
            stop = time.perf_counter() + a.duration_s
            latencies: list[float] = []

            async def worker() -> None:
                while (t0 := time.perf_counter()) < stop:
                    await pipeline.infer({"image": image})
                    latencies.append(time.perf_counter() - t0)

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            elapsed = time.perf_counter() - start
            return {"images_per_s": round(len(latencies) / elapsed, 1),
                    "p50_ms": round(1e3 * statistics.median(latencies), 2), "text": [str(t) for t in text]}

        try:
            for c in a.pipeline_concurrency:
                r = asyncio.run(run(c))
                rows.append({"backend": backend, "concurrency": c, **r})
                print(f"pipeline {backend:16} c={c:<3} {r['images_per_s']} images/s p50 {r['p50_ms']} ms", flush=True)
        finally:
            for h in hosts.values():
                h.unload()
    return rows


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join("-" if v is None else str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    out = [f"`{results['meta']['command']}` ({results['meta'].get('device', '')}, onnxruntime "
           f"{results['meta']['onnxruntime']})", ""]
    if results.get("engine"):
        out += [_table(["backend", "model", "batch", "threads", "rows/s", "p50 ms", "p99 ms", "context MB"],
                       [[r["backend"], r["model"], r["batch"], r["threads"], r["rows_per_s"], r["p50_ms"],
                         r["p99_ms"], r["context_mb"]] for r in results["engine"]]), ""]
    if results.get("switch"):
        out += [_table(["backend", "model", "batch sizes, call after call", "calls", "p50 ms", "max ms"],
                       [[r["backend"], r["model"], r["pattern"], r["calls"], r["p50_ms"], r["max_ms"]]
                        for r in results["switch"]]), ""]
    if results.get("pipeline"):
        out += [_table(["backend", "concurrent images", "images/s", "p50 ms"],
                       [[r["backend"], r["concurrency"], r["images_per_s"], r["p50_ms"]] for r in results["pipeline"]]), ""]
    if results.get("accuracy"):
        out += [_table(["model", "TF32", "max abs diff", "max rel diff", "max abs output"],
                       [[r["model"], r["tf32"], f"{r['max_abs_diff']:.3g}", f"{r['max_rel_diff']:.3g}",
                         f"{r['max_abs_output']:.3g}"] for r in results["accuracy"]]), ""]
    if results.get("memory"):
        m = results["memory"]
        out += [f"prime: {m['prime_s']} s, after it {m['after_prime']}; NVML before CUDA: "
                f"{m['nvml_process_bytes_before_cuda']}", "",
                _table(["model", "instances", "context MB", "footprint MB", "process growth MB",
                        "device growth MB", "left after unload MB", "arena cap MB"],
                       [[r["model"], r["instances"], r["context_mb"], r["footprint_total_mb"], r["process_growth_mb"],
                         r["device_growth_mb"], r["left_after_unload_mb"], r["gpu_mem_limit_mib"]] for r in m["models"]]), ""]
    return "\n".join(out)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default=str(ROOT / "engines"))
    p.add_argument("--models", default="tiny_cnn,resnet18,ocr_cls,ocr_rec,ocr_det")
    p.add_argument("--backends", default="onnxruntime_cuda,onnxruntime")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--threads", default="1,4", help="threads (= contexts) on the GPU; the CPU runs the largest")
    p.add_argument("--duration-s", type=float, default=2.0)
    p.add_argument("--pipeline-concurrency", default="1,8,32")
    p.add_argument("--parts", default="engine,pipeline,accuracy,memory",
                   help="comma-separated: engine, switch (alternating batch sizes), pipeline, accuracy, memory")
    p.add_argument("--switch-calls", type=int, default=40, help="'switch': timed calls per pattern at most")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    a.models, a.backends, a.parts = a.models.split(","), a.backends.split(","), a.parts.split(",")
    a.batches, a.threads, a.pipeline_concurrency = ints(a.batches), ints(a.threads), ints(a.pipeline_concurrency)
    # CPU sessions: the cores shared by the largest thread count (ORT's default is every core each)
    os.environ.setdefault("ORT_INTRA_OP_THREADS", str(max(1, (os.cpu_count() or 1) // max(a.threads))))

    import onnxruntime as ort

    from deployments.runtime.backends import cuda
    from deployments.runtime.contract.repository import ModelRepository

    repo = ModelRepository(a.repository)
    gpu = "onnxruntime_cuda" in a.backends
    meta = {"command": "python -m bench.gpu_engine " + " ".join(argv), "onnxruntime": ort.__version__,
            "providers": ort.get_available_providers(), "cpus": os.cpu_count(),
            "ort_intra_op_threads_cpu": os.environ["ORT_INTRA_OP_THREADS"],
            "device": cuda.device_name(0) if cuda.device_count() else "no CUDA device",
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    results: dict[str, Any] = {"meta": meta}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu-engine-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        if "memory" in a.parts and gpu:
            results["memory"] = memory_facts(repo, a.models)
        if "engine" in a.parts:
            results["engine"] = engine_rows(repo, a)
        if "switch" in a.parts:
            results["switch"] = switch_rows(repo, a)
        if "pipeline" in a.parts:
            results["pipeline"] = pipeline_rows(repo, a)
        if "accuracy" in a.parts and gpu:
            results["accuracy"] = accuracy_rows(repo, a.models)
    finally:
        stem.with_suffix(".json").write_text(json.dumps(results, indent=2, default=str))
        report = markdown(results)
        stem.with_suffix(".md").write_text(report)
        print(report)
        print(f"wrote {stem}.json, .md", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
